"""A stand-in vLLM (tests/loading/test_reliability.py::test_unrecognised_vllm_layout_real_interpreter): no installable
vLLM has a ``minicpmv4_6`` module without the window-attention classes."""

__version__ = "9.9.9"
