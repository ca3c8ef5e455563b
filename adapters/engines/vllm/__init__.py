"""vLLM: ``adapter`` (``AsyncLLM``/``LLM``), ``plugin`` (entry point ``vllm.general_plugins``), ``processes``
(front end, EngineCore, Worker), ``settings``."""
