"""Logits processing on CUDA: logit_bias and the penalties on CUDA logits equal the CPU's, stay on
the device, and the grammar mask (when xgrammar is installed on the host) forbids the same tokens.
Skipped without CUDA."""

import pytest
import torch

from k3ray.engine.structured.logits_processors import process_logits
from k3ray.sampling_params import SamplingParams, StructuredOutputsParams
from k3ray.tokenizer import ByteTokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
CUDA = torch.device("cuda", 0)


def test_bias_and_penalties_on_cuda_equal_the_cpu():
    logits = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(logit_bias={7: 3.0}, repetition_penalty=1.3, frequency_penalty=0.4),
              SamplingParams(), SamplingParams(presence_penalty=-0.5, repetition_penalty=0.9)]
    token_ids = [[1, 7, 7, 300, 2], [5], [9, 9, 40, 41]]
    prompt_lens = [2, 1, 1]
    on_gpu = process_logits(logits.to(CUDA), params, token_ids, prompt_lens)
    assert on_gpu.device == CUDA
    torch.testing.assert_close(on_gpu.cpu(), process_logits(logits, params, token_ids, prompt_lens))


def test_grammar_mask_on_cuda_equals_the_cpu():
    pytest.importorskip("xgrammar")
    from k3ray.engine.structured.structured_output import StructuredOutputs, encoded_vocab

    tok = ByteTokenizer(512)
    grammars = StructuredOutputs(encoded_vocab(tok, 512), tok.stop_token_ids)
    state = grammars.new_state(grammars.compile(StructuredOutputsParams(json={"type": "string", "maxLength": 2})))

    def allowed() -> set[int]:
        cpu, gpu = torch.zeros(2, 512), torch.zeros(2, 512, device=CUDA)
        grammars.mask(cpu, [None, state])
        grammars.mask(gpu, [None, state])
        assert torch.equal(gpu.cpu(), cpu)
        return set(torch.isfinite(cpu[1]).nonzero().flatten().tolist())

    assert allowed() == {ord('"')}
    state.accept(ord('"'))
    inside = allowed()  # any character's first byte but a control byte's (the strict-JSON mask)
    assert {ord('"'), ord("a"), 0xC3} <= inside and not inside & set(range(0x20))
