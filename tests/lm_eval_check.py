"""A tiny multiple-choice task (loglikelihood: echo + logprobs) and a tiny generation task (generate_until),
made for the tests, scored by lm-evaluation-harness's `local-completions` model against a server."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from worker.model.loader import builtin_model_path

QUESTIONS = [("The sky is", [" blue", " green", " loud", " seven"], 0),
             ("Two plus two is", [" four", " five", " blue", " a dog"], 0),
             ("def add(a, b): return", [" a + b", " a - b", " None", " print"], 0),
             ("Paris is the capital of", [" France", " Spain", " Mars", " cheese"], 0),
             ("1, 2, 3,", [" 4", " 9", " x", " 0"], 0),
             ("The opposite of hot is", [" cold", " warm", " red", " up"], 0)]
GENERATE = [("Once upon a time", "there"), ("def add(a, b):", "return"), ("A, B, C,", "D"),
            ("The quick brown fox", "jumps"), ("1 2 3", "4"), ("Hello", "world")]


def tasks(folder: Path) -> list[str]:
    """Two tasks made for this test, each a YAML file and its data in `folder`."""
    mc = [{"question": q, "choices": c, "answer": a} for q, c, a in QUESTIONS]
    gen = [{"prompt": p, "target": t} for p, t in GENERATE]
    for name, rows, spec in (
        ("neuron_di_tiny_mc", mc, {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
                                   "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
                                   "metric_list": [{"metric": "acc"}]}),
        ("neuron_di_tiny_gen", gen, {"output_type": "generate_until", "doc_to_text": "{{prompt}}",
                                     "doc_to_target": "{{target}}",
                                     "generation_kwargs": {"until": ["\n"], "max_gen_toks": 12},
                                     "metric_list": [{"metric": "exact_match"}]})):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test", **spec}
        (folder / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML
    return ["neuron_di_tiny_mc", "neuron_di_tiny_gen"]


def evaluate(url: str, model: str, folder: Path) -> dict[str, Any]:
    """lm-eval's local-completions model against `url` on both tasks, four prompts per request."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    model_args = {"model": model, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
                  "tokenizer": str(builtin_model_path()), "num_concurrent": 2, "max_retries": 1,
                  "batch_size": 4}
    return lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=tasks(folder),
                                   task_manager=TaskManager(include_path=str(folder)), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def _per_sample(results: dict[str, Any], task: str) -> list[Any]:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def assert_same_scores(got: dict[str, Any], want: dict[str, Any], tolerance: float) -> None:
    """Equal scores, equal generations, equal greedy flags, loglikelihoods within `tolerance`."""
    assert got["results"]["neuron_di_tiny_mc"]["acc,none"] == want["results"]["neuron_di_tiny_mc"]["acc,none"]
    assert got["results"]["neuron_di_tiny_gen"] == want["results"]["neuron_di_tiny_gen"]
    assert _per_sample(got, "neuron_di_tiny_gen") == _per_sample(want, "neuron_di_tiny_gen")
    mine, theirs = _per_sample(got, "neuron_di_tiny_mc"), _per_sample(want, "neuron_di_tiny_mc")
    flat = [(g[0][0], w[0][0], g[0][1] == w[0][1]) for gs, ws in zip(mine, theirs) for g, w in zip(gs, ws)]
    assert len(flat) == 4 * len(QUESTIONS) and all(greedy_same for _, _, greedy_same in flat)
    assert max(abs(float(g) - float(w)) for g, w, _ in flat) <= tolerance
