"""Cython mirrors of mie's hot loops (built by setup.py when a C compiler is available)."""
