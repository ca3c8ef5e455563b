"""TensorRT-LLM: ``adapter`` (``LLM``), ``plugin`` (``enable()``: TensorRT-LLM loads no plugins), ``processes``
(front end, executor workers), ``worker`` (the executor worker class the plugin hands over), ``settings``."""
