"""A STAND-IN for SGLang, for tests only: NOT SGLang. SGLang needs CUDA, so the tests put this
directory first on PYTHONPATH and `python -m sglang.launch_server` runs `launch_server.py` here
(see its docstring). Nothing in the project imports it."""
