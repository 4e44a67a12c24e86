"""Prompt sets: the shipped files, the toy caption splits, local files and clear errors."""

from __future__ import annotations

import json

import pytest

from data.prompts import PROMPT_DIR, PromptSetConfig, load_prompts, read_prompt_file
from models.toy.world import is_held_out


def test_shipped_prompt_sets_load_with_stable_ids():
    parti = load_prompts(PromptSetConfig(source="parti"))
    assert len(parti) == 1632 and parti[0].id == "parti:0" and parti[0].text == "bond"
    coco = load_prompts(PromptSetConfig(source="coco", count=10))
    assert len(coco) == 10 and coco[1].text == "An office cubicle with four different types of computers."
    for name in ("NOTICE.md", "PartiPrompts.LICENSE.txt"):
        assert (PROMPT_DIR / name).exists()


def test_coco_jsonl_uses_its_own_index_and_a_chosen_field():
    prompts = read_prompt_file(PROMPT_DIR / "coco2017_val_captions.jsonl", column="caption_first", prefix="coco")
    assert len(prompts) == 5000 and prompts[0].id == "coco:0"
    assert prompts[0].text == "A black Honda motorcycle parked in front of a garage."


def test_toy_prompts_are_deterministic_and_respect_the_split():
    heldout = load_prompts(PromptSetConfig(source="toy", count=8, split="heldout", seed=1))
    assert heldout == load_prompts(PromptSetConfig(source="toy", count=8, split="heldout", seed=1))
    assert all(is_held_out(p.text) for p in heldout) and heldout[3].id == "toy-heldout-s1:3"


def test_local_files_and_errors(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"caption": "a cat"}) + "\n\n" + json.dumps({"caption": "a dog"}) + "\n")
    prompts = load_prompts(PromptSetConfig(source="file", path=str(path), column="caption"))
    assert [(p.id, p.text) for p in prompts] == [("mine:0", "a cat"), ("mine:2", "a dog")]
    with pytest.raises(ValueError, match="no field 'text/prompt'"):
        read_prompt_file(path)
    tsv = tmp_path / "p.tsv"
    tsv.write_text("Text\tOther\nhello\tx\n")
    with pytest.raises(ValueError, match=r"no column 'Prompt'; columns are \['Text', 'Other'\]"):
        read_prompt_file(tsv)
    with pytest.raises(ValueError, match="needs prompts.count"):
        PromptSetConfig(source="toy")
