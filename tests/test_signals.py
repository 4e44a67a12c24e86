"""The signal study (`inference.measure.signals`): states as the tree forward computes them, decoder labels, AUC."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_drafter_models import tiny_drafter

import inference.measure.signals as signals_module
from inference.decoding.eagle import EagleDrafter
from inference.decoding.rules import CascadeRule
from inference.decoding.speculative import DecodeHooks, DecoderConfig, generate_speculative
from inference.measure.signals import (
    LABELS,
    TreeRecorder,
    node_pairs,
    node_states,
    pair_labels,
    roc_auc,
    study_signals,
    usable_nodes,
)

PROMPT = "a big green square at the top left on a striped blue background"


def naive_auc(scores: list[float], labels: list[int]) -> float:
    """P(score of a positive > score of a negative) + half the ties, over every (positive, negative) pair."""
    positives = [s for s, y in zip(scores, labels, strict=True) if y]
    negatives = [s for s, y in zip(scores, labels, strict=True) if not y]
    wins = sum((a > b) + 0.5 * (a == b) for a, b in itertools.product(positives, negatives))
    return wins / (len(positives) * len(negatives))


def test_roc_auc_equals_the_pairwise_count_with_ties_and_nans():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        scores = torch.randint(0, 6, (40,), generator=generator).double()  # many ties
        labels = (torch.rand(40, generator=generator) < 0.4).double()
        assert roc_auc(scores, labels) == pytest.approx(naive_auc(scores.tolist(), labels.int().tolist()))
    scores, labels = torch.tensor([0.1, 0.9, float("nan"), 0.5]), torch.tensor([0.0, 1.0, 1.0, float("nan")])
    assert roc_auc(scores, labels) == 1.0  # the NaN score and the NaN label are left out
    assert roc_auc(-scores, labels) == 0.0
    assert roc_auc(torch.tensor([0.3, 0.4]), torch.tensor([1.0, 1.0])) is None  # one class: undefined
    tied = torch.full((6,), 0.25, dtype=torch.float64)
    assert roc_auc(tied, torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])) == 0.5  # all tied: every pair half a win


class FeatureRecorder(DecodeHooks):
    """The decoder's own CASCADE features (cond last hidden at every node) of every verified tree."""

    def __init__(self) -> None:
        self.features: list[torch.Tensor] = []

    def on_verify(self, tree, view, verdict) -> None:
        self.features.append(view.features[0].float().cpu())


@pytest.mark.parametrize("tree", ["static", "dynamic"])
def test_node_states_are_the_states_of_the_decoders_tree_forward(tiny_target, tree):
    """The teacher-forced reconstruction (committed prefix + each node's path) gives the tree forward's states:
    it checks the recorder's root positions, paths and the state row."""
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    trees, features = TreeRecorder(), FeatureRecorder()

    class Both(DecodeHooks):
        def on_verify(self, *args) -> None:
            trees.on_verify(*args)
            features.on_verify(*args)

    generator = torch.Generator().manual_seed(3)
    result = generate_speculative(
        tiny_target, drafter, [PROMPT], CascadeRule(delta=0.0), DecoderConfig(tree=tree), generator=generator,
        hooks=Both(),
    )  # fmt: skip
    image, num_tokens = result.tokens[0], tiny_target.geometry.num_tokens
    assert len(trees.trees) == len(features.features) > 3
    kept = [(t, f) for t, f in zip(trees.trees, features.features, strict=True) if t.root_position < num_tokens - 1]
    states = node_states(tiny_target, PROMPT, image, [t for t, _ in kept])["last"]
    offset, compared = 0, 0
    for recorded, decoded in kept:
        assert int(recorded.tokens[0]) == int(image[recorded.root_position])
        usable = usable_nodes(recorded, num_tokens)
        size = recorded.tokens.shape[0]
        ours = states[offset : offset + size][usable]
        torch.testing.assert_close(ours, decoded[usable], rtol=1e-4, atol=1e-4)
        offset, compared = offset + size, compared + int(usable.sum())
    assert compared > 10


def test_pairs_and_labels_follow_the_tree_and_the_decoder(tiny_target):
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    recorder = TreeRecorder()
    result = generate_speculative(
        tiny_target, drafter, [PROMPT], CascadeRule(delta=0.0), DecoderConfig(tree="dynamic"),
        generator=torch.Generator().manual_seed(1), hooks=recorder,
    )  # fmt: skip
    image, num_tokens = result.tokens[0], tiny_target.geometry.num_tokens
    tree = recorder.trees[0]
    usable = usable_nodes(tree, num_tokens)
    siblings, edges = node_pairs(tree, "sibling", usable), node_pairs(tree, "parent", usable)
    assert siblings.shape[0] > 0 and edges.shape[0] > 0
    assert bool((tree.parents[siblings[:, 0]] == tree.parents[siblings[:, 1]]).all())
    assert bool((tree.tokens[siblings[:, 0]] != tree.tokens[siblings[:, 1]]).all())
    assert bool((tree.parents[edges[:, 0]] == edges[:, 1]).all())

    class ReadsTheMeanColour:  # a stand-in scene reader: one attribute, the image's mean grey level in tens
        def read(self, images):
            return {"mean": images.float().mean((1, 2, 3)).div(10).round()}

    patches = (tiny_target.vq.codebook.clamp(0, 1) * 255).round()  # (V, 108) grey levels: one patch per token
    a, b = patches[tree.tokens[siblings[:, 0]]], patches[tree.tokens[siblings[:, 1]]]
    patch_rms = ((a - b) ** 2).mean(-1).sqrt()  # the toy decoder is a patch lookup: the label is exact
    threshold = float(patch_rms.median())  # both classes present
    labels = pair_labels(tiny_target, image, tree, siblings, "sibling", threshold, ReadsTheMeanColour())
    assert 0 < labels["interchangeable"].sum() < siblings.shape[0]
    assert labels["interchangeable"].tolist() == (patch_rms <= threshold).double().tolist()
    committed = tree.accepted_path[tree.parents[siblings[:, 0]]]
    assert bool(labels["substitutable"][~committed].isnan().all())
    assert not bool(labels["substitutable"][committed].isnan().any())


PLANTED_INDEPENDENT_BOUND = 0.2
"""How far from 0.5 a signal independent of the label may score on the study's own pairs. Under independence the
AUC's standard deviation is sqrt((P + N + 1) / (12 P N)) for P positive and N negative pairs: about 0.05 at the
smallest table the test accepts (P, N >= 10). 0.2 is four of those; the planted noise is seeded, so the value does not
move between runs either."""


def test_study_scores_planted_signals_with_their_known_answers(tiny_target, monkeypatch):
    """Signals planted into the study's own pairs go through the same code as the real ones (`PairTable.add`,
    `SignalStudy.summary`, `roc_auc`): the label itself scores 1, its negation 0, seeded noise about 0.5. A study that
    paired signals with the wrong pairs' labels (a shuffle, an off-by-one) would score the planted label near 0.5."""
    drafter = EagleDrafter(tiny_drafter("eagle3").eval(), tiny_target)
    configs = {"static": DecoderConfig(tree="static", static_tree="mc_sim_7b_63")}
    label = LABELS[0]
    last_labels: list[torch.Tensor] = []
    noise = torch.Generator().manual_seed(7)
    real_labels, real_signals = signals_module.pair_labels, signals_module.pair_signals

    def labels_seen(*args, **kwargs):
        labels = real_labels(*args, **kwargs)
        last_labels.append(labels[label])
        return labels

    def planted(*args, **kwargs):
        out = real_signals(*args, **kwargs)
        truth = last_labels.pop()  # the labels of these very pairs, computed just before
        assert truth.shape[0] == next(iter(out.values())).shape[0]
        out["planted: the label"] = truth.clone()
        out["planted: the label, negated"] = -truth
        out["planted: noise"] = torch.rand(truth.shape, generator=noise, dtype=torch.float64)
        return out

    monkeypatch.setattr(signals_module, "pair_labels", labels_seen)
    monkeypatch.setattr(signals_module, "pair_signals", planted)
    study = study_signals(tiny_target, drafter, [PROMPT, "a small red circle in the center"], configs, 104.0)
    records = study.summary()
    signals = {r["signal"] for r in records}
    assert {"last state, centred", "high state, whitened", "softmaxed logits (Lumina dev file)"} <= signals
    assert any("LANTERN" in s for s in signals) and "drafter q, cosine" in signals
    for kind in ("sibling", "parent"):
        rows = {r["signal"]: r for r in records if r["pairs"] == kind and r["label"] == label}
        table = study.tables["static"][kind]
        truth = torch.tensor(table.labels[label])
        positives, negatives = int((truth == 1).sum()), int((truth == 0).sum())
        assert positives >= 10 and negatives >= 10, f"{kind} pairs: too few of a class ({positives}, {negatives})"
        assert rows["planted: the label"]["auc"] == 1.0
        assert rows["planted: the label, negated"]["auc"] == 0.0
        assert abs(rows["planted: noise"]["auc"] - 0.5) <= PLANTED_INDEPENDENT_BOUND, rows["planted: noise"]
        # the same planted label, shuffled against its pairs, is no longer a perfect signal
        shuffled = truth[torch.randperm(truth.shape[0], generator=torch.Generator().manual_seed(1))]
        assert roc_auc(shuffled, truth) < 0.9
    assert all(r["labelled"] == 0 for r in records if r["label"] == "substitutable")  # no reader given
