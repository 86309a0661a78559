"""Tuning tables of the Triton kernels per GPU model, and the code that reads them.
"""
