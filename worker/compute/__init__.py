"""Batches in, answers out: the CPU stage (``cpu``) and the GPU stage (``gpu``).

Both share ``triage`` (deadlines, poison isolation) and the NumPy reference
``preprocess`` and ``postprocess`` that the GPU kernels are held to.
"""
