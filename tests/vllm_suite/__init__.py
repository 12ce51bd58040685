"""vLLM 0.33.0's own tests of the KV cache manager and the scheduler, run against kvhit's plugin.

``python -m tests.vllm_suite.run`` (``make vllm-tests``) fetches vLLM 0.33.0's source distribution through pip's
configured index (:mod:`.fetch`), unpacks the tests it needs into ``build/vllm-0.33.0-tests/``, runs the files
of :mod:`.selection` once per mode (``stock``, ``off``, ``shadow``, ``enforce``) in a fresh pytest process with
our plugin ``vllm_suite_plugin`` and compares every test's outcome across the modes (:mod:`.compare`, with the
expected enforce differences of :mod:`.expected`). docs/vllm-tests.md says what it runs and why.

Nothing here is a test module of the main run: no file is named ``test_*.py``.
"""
