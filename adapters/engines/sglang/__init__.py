"""SGLang: ``adapter`` (``sgl.Engine``), ``plugin`` (entry point ``sglang.srt.plugins``), ``processes``
(tokenizer manager, schedulers), ``settings``."""
