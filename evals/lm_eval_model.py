"""`k3ray` for lm-evaluation-harness: an `LM` over the in-process engine (no server).

    import k3ray.evals.lm_eval_model  # registers the model name "k3ray"
    lm_eval.simple_evaluate(model="k3ray", model_args="pretrained=/path/to/ckpt", tasks=[...])

loglikelihood scores context + continuation in one prefill and reads the continuation's prompt
log-probabilities (greedy = every continuation token ranked first); loglikelihood_rolling sums
lm-eval's disjoint rolling windows the same way; generate_until stops at `until` strings and EOS.
Every request of a call goes to the engine at once, which batches them. Token ids are what
k3ray's server gives for the same text (special-token strings become special ids), so scores
equal `local-completions` against `k3ray serve` for the same checkpoint.
"""

from __future__ import annotations

import os

import lm_eval.models  # noqa: F401 - lm-eval only loads its own models into an empty registry: fill it first
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from k3ray.engine.llm import LLM
from k3ray.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")


@register_model("k3ray")
class K3RayLM(TemplateLM):
    def __init__(
        self,
        pretrained: str | os.PathLike | LLM | None = None,
        dtype: str = "float32",
        max_length: int | None = None,
        max_gen_toks: int = 256,
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        device: str | None = None,
        cache_memory_mb: float | None = None,
        **engine_options,
    ) -> None:
        """pretrained: a checkpoint directory (None: the default tiny K3) or an LLM to reuse;
        engine_options: EngineConfig fields (max_num_seqs, max_model_len, block_size, ...).
        batch_size / max_batch_size / device are accepted for lm-eval's sake: the engine batches
        by itself and runs the model where LLM put it."""
        super().__init__()
        if isinstance(pretrained, LLM):
            if engine_options or cache_memory_mb is not None:
                raise ValueError(f"engine options {sorted(engine_options)} only apply when pretrained is a path")
            self.llm = pretrained
        else:
            if dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
            if cache_memory_mb is not None:
                engine_options["cache_memory_bytes"] = int(float(cache_memory_mb) * 1024**2)
            self.llm = LLM(pretrained, dtype=DTYPES[dtype], **engine_options)
        self.tokenizer = self.llm.tokenizer
        if self.tokenizer is None:
            raise ValueError("the checkpoint has no tokenizer files; k3ray's lm-eval model needs one")
        max_model_len = self.llm.engine.max_model_len
        if max_length is not None and not 2 <= int(max_length) <= max_model_len:
            raise ValueError(f"max_length must be in [2, {max_model_len}] (the engine's max_model_len), "
                             f"got {max_length}")
        self._max_length = int(max_length or max_model_len)
        if int(max_gen_toks) < 1:
            raise ValueError(f"max_gen_toks must be >= 1, got {max_gen_toks}")
        self.max_gen_toks = int(max_gen_toks)

    # tokens -------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # K3's tokenizers add no BOS; special-token strings in the text become their ids, as the server does
        return self.tokenizer.encode(string, allow_special=True)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        segments = self.tokenizer.chat_segments(chat_history, add_generation_prompt=add_generation_prompt)
        return "".join(segment.text for segment in segments)

    # scoring ------------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """requests: (cache key, context ids, continuation ids); the pair is left-truncated to fit."""
        limit = self._max_length - 1  # one generated token must still fit after the prompt
        prompts, spans = [], []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("a loglikelihood continuation must hold at least one token")
            if len(continuation) >= limit:
                raise ValueError(f"a continuation of {len(continuation)} tokens does not fit "
                                 f"max_length={self._max_length}")
            ids = (list(context) + list(continuation))[-limit:]
            prompts.append(ids)
            spans.append(len(ids) - len(continuation))
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outputs = self._generate(prompts, [params] * len(prompts))
        results = []
        for (key, _, _), ids, start, out in zip(requests, prompts, spans, outputs):
            entries = [out.prompt_logprobs[i][ids[i]] for i in range(start, len(ids))]
            answer = (sum(e.logprob for e in entries), all(e.rank == 1 for e in entries))
            results.append(answer)
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Document log-likelihood over lm-eval's disjoint windows; a window (with its one context
        token) must fit the max_length - 1 prompt tokens scored, as local-completions sizes them."""
        windows, owners = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            pairs = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self._max_length - 2, context_len=1,
            )
            for context, continuation in map(lm_utils.make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(i)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # generation ---------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for context, gen_kwargs in (req.args for req in requests):
            sampling = self._sampling_params(gen_kwargs)
            room = self._max_length - sampling.max_tokens
            if room < 1:
                raise ValueError(f"max_gen_toks={sampling.max_tokens} leaves no room for a prompt in "
                                 f"max_length={self._max_length}")
            prompts.append(self.tok_encode(context)[-room:])
            params.append(sampling)
        texts = [out.outputs[0].text for out in self._generate(prompts, params)]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _sampling_params(self, gen_kwargs: dict) -> SamplingParams:
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None)
        stops = [until] if isinstance(until, str) else list(until or [])
        max_tokens = kwargs.pop("max_gen_toks", kwargs.pop("max_tokens", self.max_gen_toks))
        do_sample = bool(kwargs.pop("do_sample", False))
        unknown = sorted(set(kwargs) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"generation kwargs {unknown} are not supported by the k3ray model; "
                             f"known: until, max_gen_toks, do_sample, {', '.join(SAMPLING_KEYS)}")
        sampling = {k: kwargs[k] for k in SAMPLING_KEYS if kwargs.get(k) is not None}
        if not do_sample:
            sampling["temperature"] = 0.0
        return SamplingParams(max_tokens=int(max_tokens), stop=tuple(s for s in stops if s), **sampling)

    def _generate(self, prompts: list[list[int]], params: list[SamplingParams]):
        """All requests through the engine at once (it batches them), outputs in request order."""
        return self.llm.generate(prompts, params) if prompts else []
