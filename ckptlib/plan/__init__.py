"""ckptlib.plan"""
