from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.llmapi.llm_args import SleepConfig
from tensorrt_llm.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "SleepConfig"]
