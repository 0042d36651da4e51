"""Generation factories for the tests (`tests.generation_factories:<name>`): each records the arguments it was
called with in CALLS, so a test can see which of batch_size, prompt_len, new_tokens and device it was given."""

from __future__ import annotations

from typing import Any

import torch

CALLS: list[dict[str, Any]] = []


def _tiny_llama() -> Any:
    import transformers
    from joulepilot.compiler.generation_workloads import transformers_config

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers_config("tiny-llama", {"num_hidden_layers": 1}))


def tokens(batch_size: int, prompt_len: int) -> Any:
    """A tiny causal LM and prompts; takes two of the four arguments a factory may accept."""
    CALLS.append({"batch_size": batch_size, "prompt_len": prompt_len})
    return _tiny_llama(), torch.randint(0, 512, (batch_size, prompt_len))


def everything(**given: Any) -> Any:
    """Takes every argument (**kwargs)."""
    CALLS.append(dict(given))
    return _tiny_llama(), torch.randint(0, 512, (given["batch_size"], given["prompt_len"]))


def no_generate(batch_size: int, prompt_len: int) -> Any:
    """A model without generate()."""
    return torch.nn.Linear(4, 4), torch.randint(0, 512, (batch_size, prompt_len))


def wrong_shape(batch_size: int, prompt_len: int) -> Any:
    """Prompts of one token too many."""
    return _tiny_llama(), torch.randint(0, 512, (batch_size, prompt_len + 1))


def model_only(batch_size: int) -> Any:
    """A model alone, without input_ids."""
    return _tiny_llama()
