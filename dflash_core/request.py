"""A generation as a user asks for it, and the named variants one may ask for.

A ``Request`` holds what a front end was given (a prompt or a conversation, a variant, the
sampling settings); ``Engine.resolve`` checks it against the loaded pair and returns a
``Resolved``: the prompt ids and the one ``GenerationConfig`` the loop runs. The CLI, the studio,
the OpenAI server, the bench and training's evaluation all go through it, so each setting is
checked in one place, with one message.

Autoregressive decoding can be asked for as the variant "ar" or as block size 1; resolved, it is
always ``config.block_size == 1`` with no verification options, and the variant "ar".
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Sequence

from .errors import SettingsError
from .speculative import GenerationConfig

AR = "ar"
DFLASH = "dflash"
FLAGS = ("tree", "lookup", "adaptive")  # the order of their suffixes in a variant's name


@dataclass(frozen=True)
class Variant:
    """How a run verifies drafts. Its name is a bench method and the API's ``variant``."""

    name: str
    tree: bool = False  # a tree of the drafter's likeliest continuations (tree.py)
    lookup: bool = False  # prompt lookup's guess beside the drafts (lookup.py)
    adaptive: bool = False  # only the drafts worth their measured cost

    @property
    def autoregressive(self) -> bool:
        return self.name == AR


def _table() -> dict[str, Variant]:
    table = {AR: Variant(AR)}
    for lookup, tree, adaptive in product((False, True), repeat=3):
        on = [flag for flag, value in zip(FLAGS, (tree, lookup, adaptive)) if value]
        name = "_".join([DFLASH, *on])
        table[name] = Variant(name, tree=tree, lookup=lookup, adaptive=adaptive)
    return table


# ar, dflash, dflash_adaptive, dflash_tree, dflash_tree_adaptive, dflash_lookup, ..., dflash_tree_lookup_adaptive
VARIANTS: dict[str, Variant] = _table()


def variant(name: str) -> Variant:
    """The variant called ``name``; the "dflash_" prefix may be left out ("tree_lookup")."""
    if isinstance(name, str):
        found = VARIANTS.get(name) or VARIANTS.get(f"{DFLASH}_{name}")
        if found is not None:
            return found
    raise SettingsError(f"variant = {name!r}; allowed: ar, dflash, or dflash_ followed by tree, lookup and/or "
                        f"adaptive joined by '_' in that order (e.g. dflash_tree_lookup)")


def dflash_variant(tree: bool = False, lookup: bool = False, adaptive: bool = False) -> Variant:
    """The DFlash variant with these verification options (the CLI's flags, the studio's boxes)."""
    for flag, value in zip(FLAGS, (tree, lookup, adaptive)):
        if not isinstance(value, bool):
            raise SettingsError(f"{flag} = {value!r}; allowed: true or false")
    return next(v for v in VARIANTS.values() if not v.autoregressive and (v.tree, v.lookup, v.adaptive) == (tree, lookup, adaptive))


@dataclass(frozen=True)
class Request:
    """One generation as asked for, not yet checked (``Engine.resolve`` does that)."""

    prompt: str | None = None  # one user message through the chat template (or as is: ``raw``)
    messages: Sequence[dict[str, str]] | None = None  # a conversation ending with the user's turn
    raw: bool = False  # the prompt as is, without the chat template
    thinking: bool | None = None  # the template's thinking switch (None: the pair's, else the template's)
    variant: str = DFLASH  # a name in VARIANTS
    # None: as many as the context leaves, within DFLASH_MAX_NEW_TOKENS (OpenAI's meaning of no max_tokens).
    max_new_tokens: int | None = 256
    block_size: int | None = None  # None: the pair's (models.toml), else the drafter's; 1 = autoregressive
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    rule: str = "match"  # acceptance rule at temperature > 0 (acceptance.py)

    def generation_config(self, default_block_size: int | None = None) -> GenerationConfig:
        """The loop's settings as asked for, not yet validated (``Engine.resolve`` validates them;
        ``max_new_tokens`` None stands as 1 until the prompt's length is known)."""
        chosen = variant(self.variant)
        return GenerationConfig(
            max_new_tokens=1 if self.max_new_tokens is None else self.max_new_tokens,
            block_size=default_block_size if self.block_size is None else self.block_size,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed, rule=self.rule,
            tree=chosen.tree, lookup=chosen.lookup, adaptive=chosen.adaptive,
        )

    @classmethod
    def of(cls, prompt: str, config: GenerationConfig, mode: str = DFLASH, raw: bool = False,
           thinking: bool | None = None) -> "Request":
        """The request behind the Python API's (prompt, ``GenerationConfig``, mode) spelling."""
        if mode not in (DFLASH, AR):
            raise SettingsError(f"mode = {mode!r}; allowed: {DFLASH}, {AR}")
        chosen = VARIANTS[AR] if mode == AR else dflash_variant(config.tree, config.lookup, config.adaptive)
        return cls(prompt=prompt, raw=raw, thinking=thinking, variant=chosen.name,
                   max_new_tokens=config.max_new_tokens, block_size=config.block_size, temperature=config.temperature,
                   top_p=config.top_p, top_k=config.top_k, seed=config.seed, rule=config.rule)


@dataclass(frozen=True)
class Resolved:
    """A checked request: what the loop runs (``Engine.stream_ids(prompt_ids, config)``)."""

    prompt_ids: list[int]
    config: GenerationConfig  # validated; block_size 1 (and nothing else) means autoregressive
    variant: Variant  # "ar" exactly when config.block_size == 1
    thinking: bool | None  # the thinking choice handed to the chat template (None: its default)

    @property
    def mode(self) -> str:
        return AR if self.variant.autoregressive else DFLASH
