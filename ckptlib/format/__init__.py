"""ckptlib.format"""
