"""ckptlib.dist"""
