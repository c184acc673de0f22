"""lm-evaluation-harness through the server equals lm-evaluation-harness on the checkpoint.

The same two tasks (a multiple-choice log-likelihood task and a generation task, written as
local JSON datasets) run twice: through the server with lm-eval's ``local-completions`` model
(``echo`` + ``logprobs`` requests for the log-likelihoods, plain completions for generation),
and with lm-eval's own ``hf`` model (transformers) on the same tiny checkpoint. Every sample's
numbers must agree: the log-likelihood of each choice (to f32 round-off), whether it is the
greedy continuation, and the generated text.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("lm_eval")

from serving.app import ServerThread  # noqa: E402
from serving.config import ServerConfig  # noqa: E402
from serving.testing import synthetic_family  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.server]  # starts servers

MC_TASK = """
task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""

GEN_TASK = """
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""

MC_DOCS = [
  {"question": "The sky is", "choices": ["blue", "green", "made of cheese"], "answer": 0},
  {"question": "2 + 2 =", "choices": ["4", "5", "22"], "answer": 0},
  {"question": "Cats say", "choices": ["meow", "woof"], "answer": 0},
  {"question": "Q: capital of France?\nA:", "choices": [" Paris", " Rome", " Berlin"],
   "answer": 0},
]
GEN_DOCS = [{"question": q, "answer": "x"} for q in ("Once upon a time", "abc", "1 2 3 4")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("lm_eval")
  base, _ = synthetic_family(root, n=0)
  tasks = root / "tasks"
  tasks.mkdir()
  for name, docs, yaml in (("mc", MC_DOCS, MC_TASK), ("gen", GEN_DOCS, GEN_TASK)):
    data = root / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / f"{name}.yaml").write_text(yaml.format(data=data))
  cfg = ServerConfig(base=str(base), base_name="base", port=0, max_batch=4, max_seq_len=128,
                     default_max_tokens=16)
  with ServerThread(cfg) as h:
    yield h, base, tasks


def _run(lm, tasks_dir):
  import lm_eval
  from lm_eval.tasks import TaskManager

  out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_gen"], log_samples=True,
                                task_manager=TaskManager(include_path=str(tasks_dir)),
                                random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                fewshot_random_seed=0)
  return {t: sorted(out["samples"][t], key=lambda s: s["doc_id"]) for t in ("tiny_mc", "tiny_gen")}


def test_lm_eval_through_the_server_equals_lm_eval_on_the_checkpoint(setup):
  from lm_eval.models.huggingface import HFLM
  from lm_eval.models.openai_completions import LocalCompletionsAPI

  h, base, tasks = setup
  served = LocalCompletionsAPI(base_url=h.url + "/v1/completions", model="base",
                               tokenizer_backend="huggingface", tokenizer=str(base),
                               max_retries=1, batch_size=4, num_concurrent=1, max_length=128)
  direct = HFLM(pretrained=str(base), device="cpu", dtype="float32", batch_size=4,
                max_length=128)
  got, want = _run(served, tasks), _run(direct, tasks)
  assert len(got["tiny_mc"]) == len(MC_DOCS) and len(got["tiny_gen"]) == len(GEN_DOCS)
  for g, w in zip(got["tiny_mc"], want["tiny_mc"]):
    g_ll = np.asarray([float(r[0]) for r in g["filtered_resps"]])
    w_ll = np.asarray([float(r[0]) for r in w["filtered_resps"]])
    np.testing.assert_allclose(g_ll, w_ll, rtol=1e-4, atol=1e-4)
    assert [bool(r[1]) for r in g["filtered_resps"]] == [bool(r[1]) for r in w["filtered_resps"]]
    assert g["acc"] == w["acc"]
  for g, w in zip(got["tiny_gen"], want["tiny_gen"]):
    assert g["filtered_resps"] == w["filtered_resps"], (g["arguments"], g["resps"], w["resps"])
