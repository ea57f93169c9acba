"""ckptlib.coord"""
