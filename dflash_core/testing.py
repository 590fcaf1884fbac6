"""Tiny random models and reference drafters for the tests and ``scripts/gpu_check.py``.

One module, so the test suite and the GPU check build exactly the same targets and drafters
(test modules no longer import each other, and the script no longer reaches into ``tests/``).
It needs only torch and transformers (not pytest): the GPU check runs it from a bare python3
with the checkout on ``sys.path``. Nothing here runs at import; ``tiny_target`` seeds torch's
global generator when called, as a test that builds a model expects.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

import torch

from dflash_core.drafter import DFlashDrafter, init_drafter_weights
from dflash_core.drafter_config import DrafterConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# Families ``tiny_target`` builds. The hybrid ones alternate layer kinds (the published models
# use 3 linear : 1 full and 1 sliding : 1 full; alternating gives both kinds in 2 layers).
TINY_FAMILIES = ("llama", "qwen3", "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss")
TINY_SLIDING_WINDOW = 8  # gpt_oss: small, so generations of a few dozen tokens cross the window

# Prompts of several shapes: ordinary, one token, longer than the sliding window, repetitive
# (prompt lookup finds n-grams in the last one).
# What tests that stop or close a long answer ask the real default pair: SmolLM2 counts on to any
# token budget, where a story can end (EOS) within a second, before Stop or a closed page lands.
RUNS_TO_BUDGET = "Count from 1 to 1000 in words, one number per line."
PROMPTS = [[5, 17, 42, 8, 9, 60], [11], [70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80, 30, 31], [4, 4, 4, 4, 9, 12, 33]]


def tiny_target(family: str = "llama", vocab: int = 96, layers: int = 4, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A randomly initialised causal LM small enough for hundreds of generations per second.

    ``qwen3_5``, ``qwen3_5_moe`` and ``qwen3_next`` alternate Gated DeltaNet (linear-attention)
    and full-attention layers; ``gpt_oss`` alternates sliding-window (``TINY_SLIDING_WINDOW``)
    and full-attention layers with attention sinks and a mixture of experts."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        hybrid = dict(
            head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=[("linear_attention", "full_attention")[i % 2] for i in range(layers)],
        )
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        if family == "qwen3_5":
            model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**hybrid, **common))
        elif family == "qwen3_5_moe":
            dense = {k: v for k, v in common.items() if k != "intermediate_size"}  # experts only
            model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**hybrid, **moe, **dense))
        else:
            model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**hybrid, **moe, **common))
    elif family == "gpt_oss":
        # gpt-oss's YaRN RoPE, its factor consistent with the short context (no warning).
        rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": common["max_position_embeddings"] // 32}
        config = transformers.GptOssConfig(
            head_dim=16, sliding_window=TINY_SLIDING_WINDOW, num_local_experts=4, num_experts_per_tok=2,
            layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
            rope_parameters=rope, **common,
        )
        model = transformers.GptOssForCausalLM(config)
    else:
        raise ValueError(f"family {family!r} is not one of {TINY_FAMILIES}")
    # Sharper logits than the default init, so greedy decoding has clear winners and the
    # generated text is not one token repeated.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.to(dtype).eval()


def tiny_drafter(target: torch.nn.Module, layers: int = 1, block_size: int = 16, seed: int = 0,
                 mask_token_id: int = 3) -> DFlashDrafter:
    """A random drafter shaped for ``target`` (a Llama or Qwen3 ``tiny_target``)."""
    config = DrafterConfig.for_target(target.config, num_layers=layers, mask_token_id=mask_token_id, block_size=block_size)
    drafter = DFlashDrafter(config)
    init_drafter_weights(drafter, std=0.2, seed=seed)
    return drafter.to(target.dtype).eval()


def hybrid_drafter(model: torch.nn.Module, block_size: int = 16, seed: int = 0, mask_token_id: int = 3) -> DFlashDrafter:
    """``tiny_drafter`` for any family: an MLP width for targets whose config has none (the MoE
    Qwen3.5 text config has only expert widths), and full RoPE: the drafter is a Qwen3 model, and
    its loader refuses the partial RoPE it would copy from a Qwen3.5 target."""
    text = copy.deepcopy(model.config.get_text_config())
    text.rope_parameters = {k: v for k, v in text.rope_parameters.items() if k != "partial_rotary_factor"}
    width = getattr(text, "intermediate_size", None) or 2 * text.hidden_size
    config = DrafterConfig.for_target(text, num_layers=1, mask_token_id=mask_token_id, block_size=block_size,
                                      intermediate_size=width)
    drafter = DFlashDrafter(config)
    init_drafter_weights(drafter, std=0.2, seed=seed)
    return drafter.to(model.dtype).eval()


# A chat tokenizer for the tiny targets: one id per character plus the chat specials.
SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<mask>", "<|im_start|>", "<think>", "</think>", "<unk>"]
CHARS = "\n !',-.:?0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
# Qwen3's convention: thinking is on unless enable_thinking is false, which pre-fills an empty
# think block.
QWEN3_STYLE_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{%- endif %}"
)
PLAIN_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_chat_tokenizer(template: str = QWEN3_STYLE_TEMPLATE) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer whose ids fit the tiny targets' vocabulary of 96 (no
    downloads), with a chat template: by default Qwen3-style, writing an empty think block when
    thinking is off."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(CHARS))}
    assert len(vocab) <= 96
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
                                   unk_token="<unk>", mask_token="<mask>",
                                   additional_special_tokens=["<|im_start|>", "<think>", "</think>"])
    fast.chat_template = template
    return fast


class OracleDrafter(DFlashDrafter):
    """Proposes the reference (autoregressive) continuation: every draft should be accepted."""

    def __init__(self, base: DFlashDrafter, reference: list[int]) -> None:
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.reference = reference
        self._positions = None

    def forward(self, noise_embedding, block_positions, *args, **kwargs):  # noqa: D102
        self._positions = block_positions.reshape(-1)
        return super().forward(noise_embedding, block_positions, *args, **kwargs)

    def logits(self, hidden, lm_head_weight):  # noqa: D102
        positions = self._positions[1:].tolist()
        out = torch.full((len(positions), lm_head_weight.shape[0]), -1e4, device=hidden.device)
        for row, pos in enumerate(positions):
            out[row, self.reference[pos] if pos < len(self.reference) else 0] = 1e4
        return out.to(hidden.dtype)


class SecondChoiceDrafter(OracleDrafter):
    """Knows the reference continuation but ranks it second at every third position (a decoy
    first): a chain stops at the decoy, a tree finds the reference on its second branch."""

    def logits(self, hidden, lm_head_weight):  # noqa: D102
        positions = self._positions[1:].tolist()
        out = torch.full((len(positions), lm_head_weight.shape[0]), -20.0)
        for row, pos in enumerate(positions):
            right = self.reference[pos] if pos < len(self.reference) else 0
            out[row, right] = 5.0
            if pos % 3 == 0:
                out[row, (right + 1) % lm_head_weight.shape[0]] = 5.5
        return out.to(hidden.dtype)


class SometimesRightDrafter(OracleDrafter):
    """Proposes the reference continuation, except a wrong token at every position divisible by
    ``every``: drafts are accepted partway through blocks, so rollbacks keep every length."""

    def __init__(self, base: DFlashDrafter, reference: list[int], every: int = 5) -> None:
        super().__init__(base, reference)
        self.every = every

    def logits(self, hidden, lm_head_weight):  # noqa: D102
        out = super().logits(hidden, lm_head_weight)
        for row, pos in enumerate(self._positions[1:].tolist()):
            if pos % self.every == 0:
                out[row] = out[row].roll(1)  # the 1e4 moves to the next token id: a wrong draft
        return out


class RecordingDrafter(DFlashDrafter):
    """A real drafter that records (block start, context cache length) at every call."""

    def __init__(self, base: DFlashDrafter) -> None:
        super().__init__(base.config)
        self.load_state_dict(base.state_dict())
        self.calls: list[tuple[int, int]] = []

    def forward(self, noise_embedding, block_positions, *args, cache=None, **kwargs):  # noqa: D102
        out = super().forward(noise_embedding, block_positions, *args, cache=cache, **kwargs)
        self.calls.append((int(block_positions.reshape(-1)[0]), cache.length))
        return out


ALPHA_Z = 3.0902  # standard normal quantile of 1 - 1e-3: chi_square_passes tests at significance 1e-3


def chi_square_passes(observed: dict, expected: dict, n: int) -> tuple[bool, float, float]:
    """Chi-square goodness of fit of ``observed`` counts (of ``n`` draws) to the ``expected``
    probabilities, at significance 1e-3; cells expecting fewer than 5 are pooled. Returns
    (passes, statistic, critical value)."""
    cells, pooled_o, pooled_e = [], 0.0, 0.0
    for key, p in expected.items():
        e = p * n
        o = observed.get(key, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
        else:
            cells.append((o, e))
    if pooled_e > 0:
        cells.append((pooled_o, pooled_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    # Wilson-Hilferty approximation of the chi-square critical value.
    critical = df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3
    return stat < critical, stat, critical


# Bad input, for the Python API, the CLI (tests/test_bad_input.py) and the UI (tests/test_app.py):
# (name, prompt, settings, expected message or None when the request must succeed).
BAD_INPUT_ROWS = [
    ("empty prompt", "", {}, "the prompt is empty"),
    ("whitespace prompt", "  \n\t ", {}, "the prompt is empty"),
    ("prompt longer than the context", " ".join(str(i % 10) for i in range(15000)), {}, "the target accepts at most"),
    ("prompt over the character limit", "lorem ipsum " * 4000, {}, "characters; the limit is 32,000"),
    ("control characters", "\x00\x07\x1b[31m say hi \x7f", {}, None),
    ("invalid surrogate", "hello \ud800 world", {}, "invalid Unicode"),
    ("emoji", "🚀🔥 In one sentence, what is a rocket? 🌕", {}, None),
    ("right-to-left text", "ما هي عاصمة فرنسا؟ שלום", {}, None),
    ("max new tokens 0", "hi", {"max_new_tokens": 0}, "max_new_tokens = 0; allowed: an integer from 1 to"),
    ("max new tokens negative", "hi", {"max_new_tokens": -5}, "max_new_tokens = -5"),
    ("max new tokens huge", "hi", {"max_new_tokens": 10**9}, "max_new_tokens = 1000000000"),
    ("block size 0", "hi", {"block_size": 0}, "block_size = 0; allowed: an integer from 1"),
    ("block size 1 (autoregressive)", "hi", {"block_size": 1}, None),
    ("block size non-integer", "hi", {"block_size": 2.5}, "block_size = 2.5"),
    ("block size larger than the drafter", "hi", {"block_size": 64}, "what this drafter was trained for"),
    ("temperature negative", "hi", {"temperature": -1.0}, "temperature = -1.0"),
    ("temperature NaN", "hi", {"temperature": math.nan}, "temperature = nan"),
    ("temperature huge", "hi", {"temperature": 1e6}, "temperature = 1000000.0"),
]


# ------------------------------------------------------------------------ thinking-mode helpers
def empty_think_block(tokenizer) -> list[int]:  # noqa: ANN001
    """The ids of the empty think block a Qwen3-style template writes when thinking is off."""
    return tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False)


def contains_run(ids: list[int], part: list[int]) -> bool:
    """Whether ``part`` occurs in ``ids`` as a contiguous run."""
    return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def thinking_registry(folder, thinking_line: str = "", template: str = QWEN3_STYLE_TEMPLATE):  # noqa: ANN001, ANN201
    """A models.toml in ``folder`` with one pair, ``tiny``: a tiny qwen3 target whose chat
    template has (or, with PLAIN_TEMPLATE, lacks) the thinking switch, and a random drafter."""
    target = folder / "target"
    tiny_target("qwen3").save_pretrained(target)
    tiny_chat_tokenizer(template).save_pretrained(target)
    file = folder / "models.toml"
    file.write_text(f'[pairs.tiny]\ntarget = {{ path = "target" }}\ndrafter = {{ random = true, layers = 1 }}\n'
                    f'dtype = "float32"\n{thinking_line}\n')
    return file


# --------------------------------------------------------------- the studio in a real browser
def open_studio(browser, url: str):  # noqa: ANN001, ANN201
    """A Playwright page on the studio at ``url``, once its Generate button is there."""
    page = browser.new_page(viewport={"width": 1400, "height": 1800})
    page.goto(url, wait_until="load")
    page.wait_for_selector("#dfs-generate", timeout=60_000)
    return page


def wait_for_status(page, text: str, timeout_ms: int) -> None:  # noqa: ANN001
    page.wait_for_function(f"() => (document.querySelector('#dfs-status')?.innerText || '').includes({text!r})",
                           timeout=timeout_ms)


def generate_in_page(page, prompt: str, until: str, max_new_tokens: int | None = None) -> None:  # noqa: ANN001
    """Type a prompt in the Live tab, press Generate, wait until the status line shows ``until``."""
    page.locator("#dfs-prompt textarea").fill(prompt)
    if max_new_tokens is not None:
        page.locator("#dfs-max-new input[type=number]").fill(str(max_new_tokens))
        page.locator("#dfs-max-new input[type=number]").press("Enter")
    page.locator("#dfs-generate").click()
    wait_for_status(page, until, 240_000)


def live_channel(updates: list[dict], live_update):  # noqa: ANN001, ANN201
    """The channel (``app.channel.Channel``) that a handler's ``updates`` told the page to open."""
    import json

    from app.channel import CHANNELS

    for update in updates:
        if live_update in update and "subscribe" in json.loads(update[live_update]):
            return CHANNELS.get(json.loads(update[live_update])["subscribe"].rsplit("/", 1)[1])
    raise AssertionError("the handler never told the page where its live updates stream")


def live_messages(updates: list[dict], live_update) -> list[dict]:  # noqa: ANN001
    """Every live update a finished handler published (what the page's event stream carried)."""
    import json

    channel = live_channel(updates, live_update)
    assert channel.closed_at is not None, "the channel is still open: the handler has not finished"
    return [json.loads(m) for m in channel.messages]


def run_until_live(updates, live_update, timeout: float = 120.0):  # noqa: ANN001, ANN201
    """Start a handler's ``updates`` in a thread (the engine runs while nobody calls ``next``
    only inside one) and return ``(channel, finish)`` once its channel has a first update;
    ``finish()`` joins the thread and returns every update the handler yielded."""
    import threading
    import time

    seen: list[dict] = []
    failure: list[BaseException] = []
    opened = threading.Event()

    def drive() -> None:
        try:
            for update in updates:
                seen.append(update)
                if live_update in update:
                    opened.set()
        except BaseException as exc:  # re-raised by finish()
            failure.append(exc)
        finally:
            opened.set()

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    assert opened.wait(timeout), "no live channel"
    if failure:
        raise failure[0]
    channel = live_channel(seen, live_update)
    deadline = time.monotonic() + timeout
    while not channel.messages and channel.closed_at is None:
        assert time.monotonic() < deadline, "no live update"
        time.sleep(0.01)

    def finish() -> list[dict]:
        thread.join(timeout)
        assert not thread.is_alive(), "the handler did not end"
        if failure:
            raise failure[0]
        return seen

    return channel, finish


def stop_at_first_live_update(studio, updates, live_update, request, while_running=None):  # noqa: ANN001, ANN201
    """Run a handler's ``updates`` until its first live update, press Stop (checking it answers only
    once the run has ended) and check the engine ended within a cycle; returns every update the
    handler yielded.
    ``while_running`` is called just before Stop (what a test checks is refused mid-run)."""
    import gradio as gr

    engine = studio.service.engine(None)
    channel, finish = run_until_live(updates, live_update)
    if while_running is not None:
        while_running()
    at_stop = engine.last_run["cycles"]  # the engine is ahead of the page
    # Stop waits for the run to end and then changes nothing on the page: the run's own last
    # update, already handed over, says "stopped" (an answer of Stop's own could land after it).
    assert studio.stop(request) == gr.skip()
    assert studio.sessions.idle()  # nothing kept per session once its run is over
    rest = finish()
    assert engine.last_run["finish_reason"] == "cancelled"
    assert engine.last_run["cycles"] <= at_stop + 2  # the cycle under way, then the cancelled event
    assert not engine.busy
    return rest


def browser_session(session_hash: str) -> type:
    """A stand-in for the ``gr.Request`` Gradio passes a handler: what the studio reads of it."""
    return type("Request", (), {"session_hash": session_hash})


def exact_three_tokens(model: torch.nn.Module, prompt: list[int], temperature: float, vocab: int) -> dict[tuple, float]:
    """The target's exact distribution over its next three tokens after ``prompt`` when sampling
    at ``temperature`` (from the model alone, token by token): what sampling tests compare with."""

    def next_logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1]

    return three_token_distribution(next_logits, prompt, temperature, vocab)


def three_token_distribution(next_logits, prompt: list[int], temperature: float, vocab: int) -> dict[tuple, float]:
    """The distribution over the next three tokens after ``prompt`` sampled at ``temperature``,
    ``next_logits(ids)`` giving the next token's logits after ``ids``."""
    from dflash_core import acceptance

    def next_probs(ids: list[int]) -> torch.Tensor:
        return acceptance.warp(next_logits(ids), temperature)

    expected = {}
    p1 = next_probs(prompt)
    for a in range(vocab):
        p2 = next_probs(prompt + [a])
        for b in range(vocab):
            p3 = next_probs(prompt + [a, b])
            for c in range(vocab):
                expected[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return expected


def two_shape_llama() -> torch.nn.Module:
    """A tiny Llama whose matrices come in two shapes only (128x64: QKV, gate/up, LM head; 64x64: O,
    down), so the AOTInductor kernels to build for it are few (``aoti_kernels``, ``aoti_layers``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear greedy winners
    return model.eval()


def assert_greedy_lossless(runner, model: torch.nn.Module, max_new_tokens: int = 40) -> None:
    """Greedy DFlash == greedy AR on ``runner`` (a target runner of ``model``) for every prompt of
    ``PROMPTS`` and block sizes 2, 4 and 16, with a random drafter and with the oracle."""
    from dflash_core.speculative import GenerationConfig, collect, stream

    drafter = tiny_drafter(model, layers=1)
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=max_new_tokens, block_size=1).validated(16)))
        for block in (2, 4, 16):
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, block_size=block).validated(16)
            assert collect(stream(runner, drafter, prompt, cfg)).token_ids == ar.token_ids, block
            oracle = OracleDrafter(drafter, list(prompt) + ar.token_ids)
            assert collect(stream(runner, oracle, prompt, cfg)).token_ids == ar.token_ids, (block, "oracle")


def assert_greedy_tree_lossless(runner, model: torch.nn.Module, blocks=(4, 16), max_new_tokens: int = 40) -> None:
    """Greedy tree verification == greedy AR on ``runner`` for every prompt of ``PROMPTS`` at
    ``blocks``, with a random drafter and with a decoy (``SecondChoiceDrafter``, whose right
    tokens are on second branches: kept paths that are not the first); no tree exceeds its block."""
    from dflash_core.speculative import GenerationConfig, collect, stream

    drafter = tiny_drafter(model)
    for prompt in PROMPTS:
        ar = collect(stream(runner, None, prompt, GenerationConfig(max_new_tokens=max_new_tokens, block_size=1).validated(16)))
        decoy = SecondChoiceDrafter(drafter, list(prompt) + ar.token_ids)
        for block in blocks:
            cfg = GenerationConfig(max_new_tokens=max_new_tokens, block_size=block, tree=True).validated(16)
            for d in (drafter, decoy):
                out = collect(stream(runner, d, prompt, cfg))
                assert out.token_ids == ar.token_ids, (block, type(d).__name__)
                assert all(c.tree_nodes <= block - 1 for c in out.cycles)


def assert_same_logits(runner, reference, prompt: list[int], tolerance: float) -> None:
    """``runner`` and ``reference`` (target runners of one model) give ``prompt``'s logits within
    ``tolerance``, relative to the reference's norm: their kernels' rounding apart."""
    ids = torch.tensor(prompt)
    for r in (runner, reference):
        r.reset(64)
    got, want = runner.forward(ids, None).logits, reference.forward(ids, None).logits
    assert (got - want).norm() <= tolerance * want.norm(), float((got - want).norm() / want.norm())


def random_tree(seed: int, budget: int = 12, slots: int = 6, k: int = 4):
    """A draft tree of ``budget + 1`` nodes over token ids 4..89, from random drafter choices."""
    from dflash_core.tree import build_tree

    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(slots, k, generator=g).sort(descending=True).values.tolist()
    tokens = torch.randint(4, 90, (slots, k), generator=g).tolist()
    return build_tree(60, probs, tokens, budget)


def assert_tree_nodes_are_their_paths(runner, prompt: list[int], seeds=range(3), layer_ids=(0, 2)) -> None:
    """``runner.forward_tree`` scores every node of depth-first random trees after ``prompt`` as
    decoding its path token by token does: bit for bit where the runner's probe found its rows
    independent of their company (``batch_invariant``), else within rounding."""
    from dflash_core.tree import depth_first

    for seed in seeds:
        tree = depth_first(random_tree(seed))
        runner.reset(len(prompt) + 64)
        runner.forward(torch.tensor(prompt), None)
        out = runner.forward_tree(tree, list(layer_ids))
        for node in range(len(tree)):
            runner.reset(len(prompt) + 64)
            runner.forward(torch.tensor(prompt), None)
            for n in tree.path(node):
                ref = runner.forward(torch.tensor([tree.tokens[n]]), list(layer_ids))
            if runner.batch_invariant:
                assert torch.equal(ref.logits[-1], out.logits[node]), (seed, node)
                assert torch.equal(ref.features[-1], out.features[node]), (seed, node)
            else:
                torch.testing.assert_close(ref.logits[-1], out.logits[node], rtol=0, atol=1e-4)


def eager_layers_twin(runner):
    """``runner`` (a ``FastTarget`` whose layers run fused, ``q4_layers``) with its layers eager
    (the same products, the norms, adds and attention in PyTorch) and a cache of its own; its head,
    the same. (A target built eager would not do: an fp32 target's oneDNN head gives a row other
    numbers with the size of its pass on some CPUs, and the probe then runs it bf16.)"""
    from dataclasses import fields

    from dflash_core.families import FusedLayer
    from dflash_core.kv_cache import KVCache

    twin = copy.copy(runner)
    twin.layers = [FusedLayer(**{f.name: getattr(layer, f.name) for f in fields(FusedLayer)}) for layer in runner.layers]
    twin.attention, twin.compiled_layers = None, False
    twin.cache = KVCache(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype, runner.device)
    return twin


def attention_note(runner) -> str:
    """What the load note says of a compiled-layers target's attention: ``dot_attention``'s C++
    call where it runs here, else the AOTInductor kernel."""
    from dflash_core import dot_attention

    return dot_attention.NOTE if dot_attention.refusal(runner) is None else "attention compiled"


def llama_with_q8_0_head():
    """``two_shape_llama`` whose LM head holds Q8_0 values, as loading a GGUF dequantizes its
    output matrix, and those blocks (``weight_formats.Q8Blocks``), for the file-head kernels."""
    from dflash_core.weight_formats import quantize_q8

    model = two_shape_llama()
    blocks = quantize_q8(model.lm_head.weight.detach())
    with torch.no_grad():
        model.lm_head.weight.copy_(blocks.dequantize())
    return model, blocks
