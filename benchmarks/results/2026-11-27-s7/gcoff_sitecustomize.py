"""Throwaway experiment (issue 36): the cycle collector off in the worker."""

import gc

gc.disable()
