"""ckptlib.engine"""
