"""The peers a bench compares the server with: llama.cpp (llama-cpp-python in process, one
sequence; llama.cpp's own ``llama-server`` for continuous batching) and transformers.

``llama-server``: ``--llama-server PATH`` or ``$LLAMA_SERVER`` (`llama_server_binary`); build it
from the llama-cpp-python sdist's vendored llama.cpp: ``cmake -B build -DLLAMA_CURL=OFF &&
cmake --build build --target llama-server``.
"""

from __future__ import annotations

import os
import subprocess
import time


def llama_server_binary() -> str | None:
  """llama.cpp's llama-server binary named by ``$LLAMA_SERVER`` (None: those peers are left out)."""
  return os.environ.get("LLAMA_SERVER")


def launch_llama_server(binary: str, gguf, port: int, log, parallel: int = 8, ctx: int = 256):
  """llama.cpp's own server (continuous batching over ``parallel`` sequences of ``ctx`` tokens,
  2 threads), the batched peer of our server: llama-cpp-python's API runs one sequence."""
  cmd = [binary, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", "2", "-tb",
         "2", "-np", str(parallel), "-c", str(ctx * parallel), "--no-webui"]
  return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


class LlamaCpp:
  """llama-cpp-python on a GGUF file: one sequence, greedy."""

  def __init__(self, path, threads: int, n_ctx: int = 2048):
    from llama_cpp import Llama

    self.llm = Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                     n_batch=512, verbose=False, seed=0)

  def ids(self, text: str) -> list[int]:
    return self.llm.tokenize(text.encode(), add_bos=False, special=True)

  def generate(self, text: str, n: int) -> dict:
    """Greedy, exactly ``n`` tokens, from an empty KV cache."""
    ids = self.ids(text)
    self.llm.reset()
    out, ttft = [], None
    t0 = time.perf_counter()
    for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                 repeat_penalty=1.0, reset=True):
      if ttft is None:
        ttft = time.perf_counter() - t0
      out.append(tok)
      if len(out) == n:
        break
    return {"ids": out, "ttft": ttft, "latency": time.perf_counter() - t0, "tokens": n}


class HF:
  """transformers' ``generate`` on an HF checkpoint, f32, greedy."""

  def __init__(self, base):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(os.cpu_count() or 2)
    self.torch = torch
    self.tok = AutoTokenizer.from_pretrained(base)
    self.tok.padding_side = "left"
    if self.tok.pad_token is None:
      self.tok.pad_token = self.tok.eos_token
    self.model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()

  def render(self, q):
    return self.tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                        add_generation_prompt=True)

  def generate(self, prompts, max_tokens):
    enc = self.tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with self.torch.no_grad():
      t0 = time.perf_counter()
      out = self.model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                do_sample=False, pad_token_id=self.tok.pad_token_id)
      wall = time.perf_counter() - t0
    new = out[:, enc["input_ids"].shape[1]:]
    return [self.tok.decode(r, skip_special_tokens=True) for r in new], new.numel(), wall
