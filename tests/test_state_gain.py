"""Teacher-forced eval as decoding drafts (chained Markov drafts), and the state gain: what the verifier's states bring.

A synthetic store makes the answer readable from the states: at each position the target layers hold the
verifier's embedding of the token it predicts one position later, which is what a block anchored at the
next position drafts first. Its context (the states before the anchor) then holds the answer, which the
token sequence alone does not.
"""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import LAYERS, fit, prompt_ids, train_cfg
from dspark.verifier import resolved
from dspark.connector.base import Sample
from dspark.connector.zarr.reader import ZarrStore
from dspark.connector.zarr.writer import ZarrSink
from dspark.decode.config import SamplingConfig
from dspark.decode.drafter import Drafter
from dspark.decode.loop import autoregressive
from dspark.decode.verifier import Verifier
from dspark.eval.config import TeacherForcedConfig
from dspark.eval.teacher_forced import run_eval
from dspark.data.prepare import PreparedData
from dspark.train.blocks import control_states, documents, score, with_donors
from dspark.verifier.info import VerifierInfo


def rewrite_states(store: Path, out: Path, states) -> Path:
    """A copy of `store` whose target-layer states are `states(sample)` (the last layer, the targets, kept)."""
    src = ZarrStore(store)
    sink = ZarrSink(out, src.manifest)
    for i in src.sample_ids:
        s = src.read(i)
        h = s.hidden_states.clone()
        h[:, :-1] = states(s).to(h.dtype)
        sink.write(Sample(i, s.token_ids.copy(), h))
    sink.close()
    return out


@pytest.fixture(scope="module")
def coded_store(store, verifier, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32)
    embed = m.get_input_embeddings().weight.detach()

    def answer_ahead(s):
        with torch.no_grad():  # the verifier's argmax at each position, from its own last layer
            predicted = m.lm_head(m.model.norm(s.hidden_states[:, -1].float())).argmax(-1)
        code = torch.zeros(len(predicted), embed.shape[1])
        code[:-1] = embed[predicted[1:]]
        return code[:, None].expand(-1, len(LAYERS), -1)

    return rewrite_states(store, tmp_path_factory.mktemp("stores") / "coded", answer_ahead)


@pytest.fixture(scope="module")
def zeroed_store(store, tmp_path_factory) -> Path:
    return rewrite_states(store, tmp_path_factory.mktemp("stores") / "zeroed",
                          lambda s: torch.zeros(s.hidden_states[:, :-1].shape))


@pytest.mark.slow
def test_states_that_hold_the_answer_show_as_a_gain_and_a_drafter_that_never_saw_them_gains_nothing(
        coded_store, zeroed_store, prepared, verifier, tmp_path):
    coded = train_cfg(coded_store, prepared, verifier, tmp_path / "coded", epochs=10, checkpoint_freq=1.0, lr=1e-2)
    records = fit(coded)
    gains = [r["metrics"]["state_gain_pos1_match"] for r in records if r["split"] == "val"]
    assert len(gains) == 10 and min(gains[-3:]) > 0.1  # each validation logs it (a small split: noisy)
    result, out = run_eval(TeacherForcedConfig(checkpoint=os.path.join(coded.save_path, "latest"),
                                               output=str(tmp_path / "e1"), split="all"))
    first = result["positions"][0]
    assert result["state_gain"]["positions"][0] == pytest.approx(
        first["greedy_match"] - max(first["zeroed_match"], first["other_sample_match"]))
    assert result["state_gain"]["positions"][0] > 0.2 and result["state_gain"]["tau_greedy"] > 0.5
    assert "state gain" in (out / "eval.md").read_text()

    # trained with zeroed states, then scored on the states that hold the answer: it never learned to read them
    blind = train_cfg(zeroed_store, prepared, verifier, tmp_path / "blind", epochs=6, checkpoint_freq=1.0)
    fit(blind)
    result, _ = run_eval(TeacherForcedConfig(checkpoint=os.path.join(blind.save_path, "latest"),
                                             store=str(coded_store), output=str(tmp_path / "e2"), split="all"))
    assert abs(result["state_gain"]["positions"][0]) < 0.05
    # on the zeroed store every variant sees zeros: exactly no gain
    result, _ = run_eval(TeacherForcedConfig(checkpoint=os.path.join(blind.save_path, "latest"),
                                             output=str(tmp_path / "e3"), split="all"))
    assert result["state_gain"]["positions"] == [0.0] * 8


@pytest.mark.parametrize("sample_from_anchor,head", [(True, "vanilla"), (True, "gated"), (True, "rnn"),
                                                     (False, "vanilla")])
def test_teacher_forced_drafts_are_the_decode_loops_and_tau_its_acceptance(sample_from_anchor, head, store, prepared,
                                                                          verifier, tmp_path):
    """On the verifier's own greedy continuation, every block eval scores drafts what the decode loop's drafter
    drafts at that anchor, and its greedy tau is the decode loop's acceptance there."""
    from dspark.train.model import build_model

    cfg = train_cfg(store, prepared, verifier, tmp_path / "r", sample_from_anchor=sample_from_anchor,
                    markov_head_type=head)
    torch.manual_seed(0)
    model = build_model(cfg, PreparedData(prepared), torch.device("cpu"), resolved.Verifier.resolve(verifier)).eval()
    with torch.no_grad():  # a Markov bias that outweighs the logits: a draft chained from a wrong token shows
        model.markov_head.markov_w1.weight.mul_(300)
    prompt = prompt_ids(prepared, 1)[0]
    # + the last layer: the targets
    v = Verifier(verifier, [*LAYERS, VerifierInfo.load(verifier).num_hidden_layers], "float32")
    greedy = SamplingConfig(temperature=0.0, ignore_eos=True)
    ids = torch.tensor(prompt + autoregressive(v, prompt, 40, sampling=greedy).tokens)
    v.reset()
    _, states = v.forward(ids)
    H = states.shape[1] // (len(LAYERS) + 1)
    T, B = len(ids), model.block_size
    batch = {"hidden_states": states[None, :, :-H], "verifier_last_hidden_states": states[None, :, -H:],
             "input_ids": ids[None], "loss_mask": (torch.arange(T) >= len(prompt)).long()[None],
             "document_ids": torch.zeros(1, T, dtype=torch.long), "position_ids": torch.arange(T)[None]}
    blocks = score(model, batch, anchors=T, seed=0)
    assert len(blocks.anchors) == T - B - len(prompt)  # every anchor with a whole block after it
    drafter = Drafter(model, "dspark")
    for p, drafts, match in zip(blocks.anchors.tolist(), blocks.drafts, blocks.match):
        proposed = drafter.propose(drafter.context(ids[:p], states[:p, :-H]), int(ids[p]), greedy).tokens.numpy()
        np.testing.assert_array_equal(drafts, proposed)
        # greedy: the verifier accepts drafts (of tokens p+1, p+2, ...) while they are its own continuation
        accepted = np.cumprod(proposed == ids[p + 1: p + 1 + len(proposed)].numpy()).sum()
        assert np.cumprod(match).sum() == accepted
    # speculators' teacher forcing feeds the Markov head the data's tokens: other drafts, where a draft was wrong
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(0)
        hidden, logits, _, _, idx = model._backbone_forward(**batch, max_anchors=T)
        tokens = ids[idx].view(-1, B)
        prev = tokens if sample_from_anchor else torch.cat([tokens[:, :1], tokens[:, :-1]], 1)
        forced = logits.view(-1, B, logits.shape[-1]) + model.markov_head.block_bias(
            prev_token_ids=prev, hidden_states=hidden.view(-1, B, hidden.shape[-1]))
    forced = forced.argmax(-1)[:len(blocks.drafts), 0 if sample_from_anchor else 1:].numpy()
    assert (forced != blocks.drafts).any()


def test_controls_replace_each_document_with_another_samples_states_position_by_position():
    def batch(*lengths, base=0):
        docs = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])
        return {"hidden_states": (base + torch.arange(len(docs), dtype=torch.float32))[None, :, None].expand(1, -1, 2),
                "document_ids": docs[None], "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}

    a, b, c = batch(3, 2), batch(4, base=100), batch(2, base=200)
    paired = list(with_donors([a, None, b, c]))
    assert [i for i, *_ in paired] == [2, 3, 0]  # the first batch waits for the last one's documents
    (_, _, donors_b), (_, _, donors_c), (_, _, donors_a) = paired
    assert [d[:, 0].tolist() for d in donors_b] == [[0, 1, 2], [3, 4]]
    assert [d[:, 0].tolist() for d in donors_a] == [[200, 201]]
    other = control_states(b, "other_sample", donors_b)[0, :, 0].tolist()
    assert other == [0, 1, 2, 0]  # document 0 takes a's document 0, cycled where it is shorter
    assert control_states(a, "other_sample", donors_a)[0, :, 0].tolist() == [200, 201, 200, 200, 201]
    assert not control_states(a, "zeroed", None).any()
    # a lone batch pairs its own documents; one lone document has no other sample
    (_, _, donors), = with_donors([a])
    assert [d[:, 0].tolist() for d in donors] == [[3, 4], [0, 1, 2]]
    (_, _, donors), = with_donors([c])
    assert donors is None and control_states(c, "other_sample", None) is None
    assert [len(d) for d in documents(a)] == [3, 2]
