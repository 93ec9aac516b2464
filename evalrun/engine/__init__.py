"""The evalrun engine: model, tokenizer, paged KV cache, scheduler, sampler, generator."""
from .cache import PagedCache
from .config import ModelConfig
from .generator import DynamicGenerator
from .job import DynamicJob
from .model import Model, kernel_backends
from .sampler import SamplerSettings
from .tokenizer import Tokenizer
from .types import GeneratorResult, GeneratorStats

__all__ = [
    "DynamicGenerator", "DynamicJob", "GeneratorResult", "GeneratorStats", "Model", "ModelConfig",
    "PagedCache", "SamplerSettings", "Tokenizer", "kernel_backends",
]
