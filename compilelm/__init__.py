"""compilelm: a torch.compile-based compiler stack for serving LLMs."""

from compilelm.inputs import PromptType, TextPrompt, TokensPrompt
from compilelm.outputs import CompletionOutput, RequestOutput
from compilelm.sampling_params import SamplingParams
from compilelm.version import __version__

__all__ = ["LLM", "CompletionOutput", "PromptType", "RequestOutput", "SamplingParams", "TextPrompt", "TokensPrompt",
           "__version__"]


def __getattr__(name):  # LLM pulls in torch + transformers: import it on first use
    if name == "LLM":
        from compilelm.llm import LLM
        return LLM
    raise AttributeError(name)
