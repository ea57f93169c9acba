"""ckptlib.testing"""
