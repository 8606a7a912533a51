"""A Hugging Face folder compiles with the head it was saved with, and the report says where it does not.

Multiple-choice, pre-training, next-sentence, CTC, x-vector, depth and video heads had no task: init wrote
`feature-extraction`, and the export built AutoModel from the folder. Their heads were left out without a word in
the report (transformers' loading table went to the stage log, and with a plain log writer for stdout it failed
the export: "'LogWriter' object has no attribute 'isatty'"). A base checkpoint compiled with a classification task
got a classifier initialized at random, which every stage then matched faithfully."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

transformers = pytest.importorskip("transformers")

TINY_BERT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=64)


def _save(cls, folder: Path) -> Path:
    import torch

    torch.manual_seed(0)
    cls(transformers.BertConfig(**TINY_BERT)).save_pretrained(folder)
    return folder


def _compile(tmp_path: Path, cli_run, recipe: dict) -> tuple[object, dict]:
    recipe["data"] = {"eval": {"source": "synthetic", "samples": 4}}
    recipe["stages"] = {"export": recipe["stages"]["export"]}
    recipe["dims"]["sequence"]["opt"] = 16
    recipe["evaluate"] = {**recipe.get("evaluate", {}), "batch_sizes": [1], "warmup": 1, "iterations": 2}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    result = cli_run("compile", str(tmp_path / "recipe.yaml"))
    report = json.loads((tmp_path / "runs" / recipe["name"] / "report.json").read_text())
    return result, {s["name"]: s for s in report["stages"]}


def test_a_multiple_choice_folder_gets_its_head_and_a_choices_dim(tmp_path, cli_run, monkeypatch):
    _save(transformers.BertForMultipleChoice, tmp_path / "mc")
    monkeypatch.chdir(tmp_path)
    assert cli_run("init", "mc", "-o", "mc.yaml").exit_code == 0
    recipe = yaml.safe_load(Path("mc.yaml").read_text())
    assert recipe["model"]["task"] == "multiple-choice" and recipe["evaluate"]["task"] == {"kind": "classification"}
    assert recipe["inputs"][0]["shape"] == ["batch", "choices", "sequence"] and "choices" in recipe["dims"]
    result, rows = _compile(tmp_path, cli_run, recipe)
    assert result.exit_code == 0, result.output
    assert not rows["export"]["warnings"]  # every weight of the folder used, none made up


def test_a_pretraining_folder_compiled_as_its_encoder_says_its_heads_are_left_out(tmp_path, cli_run, monkeypatch):
    _save(transformers.BertForPreTraining, tmp_path / "pt")
    monkeypatch.chdir(tmp_path)
    assert cli_run("init", "pt", "-o", "pt.yaml").exit_code == 0
    recipe = yaml.safe_load(Path("pt.yaml").read_text())
    assert recipe["model"]["task"] == "pretraining"
    recipe["model"]["task"] = "feature-extraction"  # the encoder alone, for embeddings: allowed, and said
    result, rows = _compile(tmp_path, cli_run, recipe)
    assert result.exit_code == 0, result.output  # the loading table no longer fails the export
    (warning,) = [w for w in rows["export"]["warnings"] if "does not use" in w]
    assert "cls.predictions" in warning and "BertForPreTraining" in warning and "`model.task`" in warning


def test_a_base_checkpoint_compiled_with_a_classifier_says_the_classifier_is_random(tmp_path, cli_run, monkeypatch):
    _save(transformers.BertModel, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    assert cli_run("init", "base", "-o", "base.yaml").exit_code == 0
    recipe = yaml.safe_load(Path("base.yaml").read_text())
    recipe["model"]["task"] = "sequence-classification"
    result, rows = _compile(tmp_path, cli_run, recipe)
    assert result.exit_code == 0, result.output
    (warning,) = [w for w in rows["export"]["warnings"] if "initialized at random" in w]
    assert "classifier.weight" in warning and "AutoModelForSequenceClassification" in warning


def test_a_one_label_classifier_is_a_regression_with_no_classification_task(tmp_path, cli_run, monkeypatch):
    """num_labels 1 (an STS-B style regression head): init wrote `task: {kind: classification}`, whose top-1 agreement
    over one class read 1.000 on every stage, ov-bf16 included, where R² read -60."""
    import torch

    torch.manual_seed(0)
    config = transformers.BertConfig(**TINY_BERT, num_labels=1, architectures=["BertForSequenceClassification"])
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path / "scorer")
    monkeypatch.chdir(tmp_path)
    result = cli_run("init", "scorer", "-o", "scorer.yaml")
    assert result.exit_code == 0, result.output
    recipe = yaml.safe_load((tmp_path / "scorer.yaml").read_text())
    assert recipe["model"]["task"] == "sequence-classification" and "task" not in recipe["evaluate"]
    assert "one label (a regression): no classification task" in result.output


def test_a_token_classifier_gets_a_classification_task_read_per_token(tmp_path, cli_run, monkeypatch):
    """init wrote no task for a ...ForTokenClassification head (NER): its stages were held by the cosine alone, and a
    classification task written by hand read one argmax over each sentence's tokens and classes together."""
    _save(transformers.BertForTokenClassification, tmp_path / "ner")
    monkeypatch.chdir(tmp_path)
    assert cli_run("init", "ner", "-o", "ner.yaml").exit_code == 0
    recipe = yaml.safe_load(Path("ner.yaml").read_text())
    assert recipe["model"]["task"] == "token-classification" and recipe["evaluate"]["task"] == {"kind": "classification"}
    result, rows = _compile(tmp_path, cli_run, recipe)
    assert result.exit_code == 0, result.output
    assert rows["export"]["accuracy"]["task"]["metrics"]["top1_agreement"] == 1.0


def test_a_question_answering_head_gets_both_its_logits_in_one_task(tmp_path, cli_run, monkeypatch):
    """init wrote no task for a ...ForQuestionAnswering head: its start and end logits were held by the cosine alone,
    which lets an answer's span move."""
    _save(transformers.BertForQuestionAnswering, tmp_path / "qa")
    monkeypatch.chdir(tmp_path)
    assert cli_run("init", "qa", "-o", "qa.yaml").exit_code == 0
    recipe = yaml.safe_load(Path("qa.yaml").read_text())
    assert recipe["evaluate"]["task"] == {"kind": "classification", "output": ["start_logits", "end_logits"]}
    result, rows = _compile(tmp_path, cli_run, recipe)
    assert result.exit_code == 0, result.output
    task = rows["export"]["accuracy"]["task"]
    assert task["output"] == "start_logits, end_logits" and task["metrics"]["top1_agreement"] == 1.0

