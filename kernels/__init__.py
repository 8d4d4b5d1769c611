"""Kernels: Triton implementations and their torch twins (``kernels.ref``)."""
