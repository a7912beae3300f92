"""Train a small GPT-2 on several ranks with DDP or FSDP2, remat planning every compiled graph.

The loop is PyTorch's own: the model is wrapped by DistributedDataParallel or sharded with
FSDP2's ``fully_shard``, and the only remat line is the ``torch.compile`` backend. Each rank
compiles the same graphs; for each graph the ranks agree on one budget and one plan (rank 0
solves it, or finds it in its plan cache, and sends it to the others), so every rank runs the
same program within the same memory.

    torchrun --nproc-per-node 2 examples/distributed.py --ddp            # CPU, gloo
    torchrun --nproc-per-node 2 examples/distributed.py --fsdp --check   # compare with FSDP2 without remat
    torchrun --nproc-per-node 8 examples/distributed.py --fsdp --device cuda --budget cuda-free

``--check`` runs the same loop again without remat (same engine, same weights, data and dropout
masks) and compares the losses and the parameters after the last optimizer step; it exits 1 if
any differs by more than ``--atol`` (0: bitwise, what CPU gives) or if remat left a graph to
PyTorch's partitioner. About a minute on two CPU cores.

How each engine is compiled:

* DDP: ``torch.compile(DDP(model), backend=...)``. The model returns its loss, so the forward,
  the loss and the backward of a step are one graph per DDP bucket (one here). DDP's
  all-reduce hooks run as usual.
* FSDP2: ``fully_shard`` on every transformer block and on the root; every block is compiled on
  its own (``block.compile(backend=...)``), as FSDP2 runs its all-gathers in hooks around each
  block. remat plans each block's graph, whose inputs are the all-gathered parameters, counted
  while the block runs; the budget applies to each block's graph (80% by default: a block's
  own backward needs most of its activations at once). For one plan over the whole step, shard
  the root module alone and compile it like the DDP model.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import remat
from remat.backend import RematFallbackWarning
from remat.cli_args import Parser, arg_type, backend_budget, method_name, positive_int, thread_count
from remat.cost import CostModel
from remat.units import EAGER, check_budget


#: A block's graph holds its parameters, input and gradients beside its activations, and its own
#: backward needs most of its activations at once: it cannot go as low as a whole step's graph.
DEFAULT_BUDGET = {"ddp": "70%", "fsdp": "80%"}
#: GPT-2's attention heads: the width is a multiple of them.
HEADS = 4


class LanguageModel(nn.Module):
    """GPT-2 whose forward returns the next-token loss, so that the loss is inside the compiled
    graph (and inside the plan) rather than after it."""

    def __init__(self, gpt2: nn.Module) -> None:
        super().__init__()
        self.gpt2 = gpt2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # An explicit attention mask (GPT-2's default masking branches on tensor values) and no
        # key/value cache (training does not need it). The loss is computed here, not with
        # labels=: transformers' loss path logs once, which would split the compiled graph.
        logits = self.gpt2(ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def gpt2(args: argparse.Namespace) -> LanguageModel:
    """A small GPT-2 with random weights (no download), dropout 0.1, tied embeddings."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers, n_head=HEADS,
                        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)  # the same weights on every rank
    return LanguageModel(GPT2LMHeadModel(config)).train()


def batches(args: argparse.Namespace, rank: int, device: torch.device) -> list[torch.Tensor]:
    """Each rank its own token ids, the same in both runs of ``--check``."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device) for _ in range(args.steps)]


def wrap(model: LanguageModel, args: argparse.Namespace, device: torch.device, backend) -> nn.Module:
    """``model`` under the chosen engine, compiled with ``backend`` (None: not compiled)."""
    model = model.to(device)
    if args.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        return ddp if backend is None else torch.compile(ddp, backend=backend)
    from torch.distributed.fsdp import fully_shard

    for block in model.gpt2.transformer.h:
        fully_shard(block)
        if backend is not None:
            block.compile(backend=backend)
    fully_shard(model)
    return model


def train(args: argparse.Namespace, device: torch.device, backend) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The training loop: the losses of every step and the parameters after the last one."""
    rank = dist.get_rank()
    model = wrap(gpt2(args), args, device, backend)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step, ids in enumerate(batches(args, rank, device)):
        torch.manual_seed(10 * step + rank)  # each rank its own dropout masks, the same in both runs
        loss = model(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        if rank == 0:
            print(f"step {step + 1}: loss {loss.item():.4f} (rank 0)", flush=True)
    # FSDP2 keeps DTensor shards: compare whole parameters
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return losses, [p.detach().cpu() for p in params]


def differences(planned: tuple[list, list], reference: tuple[list, list], atol: float) -> list[str]:
    """What differs between two runs by more than ``atol`` (empty: they match)."""
    found = []
    for name, got, want in (("loss", planned[0], reference[0]), ("parameter", planned[1], reference[1])):
        if len(got) != len(want):
            found.append(f"{len(got)} {name} values against {len(want)}")
            continue
        for k, (a, b) in enumerate(zip(got, want)):
            diff = float((a.float() - b.float()).abs().max()) if a.shape == b.shape else float("inf")
            if diff > atol or (atol == 0 and not torch.equal(a, b)):
                found.append(f"{name} {k} differs by {diff:.3g}")
    return found


def sequence_length(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise ValueError(f"{value} must be at least 2 (the model predicts each next token)")
    return value


def width(text: str) -> int:
    value = positive_int(text)
    if value % HEADS:
        raise ValueError(f"{value} is not a multiple of the {HEADS} attention heads; e.g. {HEADS * max(1, value // HEADS)}")
    return value


def tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number; e.g. --atol 1e-6 (0: bitwise)") from None
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{text} must be 0 (bitwise) or a positive, finite number; e.g. --atol 1e-6")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # (remat's parser: a usage error is one line, exit code 2; every option is checked before
    # anything starts, and before whether this runs under torchrun)
    parser = Parser(prog="distributed.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    engine = parser.add_mutually_exclusive_group()
    engine.add_argument("--ddp", dest="engine", action="store_const", const="ddp", help="DistributedDataParallel (default)")
    engine.add_argument("--fsdp", dest="engine", action="store_const", const="fsdp", help="FSDP2: fully_shard per block")
    parser.set_defaults(engine="ddp")
    parser.add_argument("--budget", type=arg_type(backend_budget), default=None,
                        help="per graph: a fraction ('70%', 0.7), bytes per device ('2GiB') or cuda-free (default: "
                             f"{DEFAULT_BUDGET['ddp']} with --ddp, {DEFAULT_BUDGET['fsdp']} with --fsdp)".replace("%", "%%"))
    parser.add_argument("--method", type=arg_type(method_name), default="segments",
                        help="remat method (see `remat methods`; default %(default)s)")
    parser.add_argument("--steps", type=arg_type(positive_int), default=3, help="training steps (default %(default)s)")
    parser.add_argument("--batch", type=arg_type(positive_int), default=8, help="batch size per rank (default %(default)s)")
    parser.add_argument("--seq", type=arg_type(sequence_length), default=128,
                        help="sequence length (default %(default)s)")
    parser.add_argument("--layers", type=arg_type(positive_int), default=2, help="GPT-2's layers (default %(default)s)")
    parser.add_argument("--width", type=arg_type(width), default=64,
                        help=f"GPT-2's width, a multiple of its {HEADS} heads (default %(default)s)")
    parser.add_argument("--vocab", type=arg_type(positive_int), default=512, help="vocabulary size (default %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to train (default %(default)s)")
    parser.add_argument("--threads", type=thread_count(), default=1, help="intra-op threads per rank (default %(default)s)")
    parser.add_argument("--check", action="store_true", help="compare with the same loop without remat")
    parser.add_argument("--atol", type=arg_type(tolerance), default=0.0,
                        help="--check tolerance (default 0: bitwise)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available on this machine; run on CPU with --device cpu")
    if args.budget is not None and check_budget(args.budget, cuda_free=True, of=EAGER) == "cuda-free" \
            and args.device != "cuda":
        parser.error("--budget cuda-free is the free memory of a CUDA device: give --device cuda, or a fraction or "
                     "bytes on CPU")
    if "RANK" not in os.environ:
        # (not bad usage of an option: how to start it, without the pointer to --help)
        parser.exit(2, f"{parser.prog}: error: run me with torchrun, e.g. torchrun --nproc-per-node 2 "
                       f"examples/distributed.py --ddp\n")
    args.budget = args.budget or DEFAULT_BUDGET[args.engine]
    args.budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    backend = remat.backend(args.budget, method=args.method, cost_model=CostModel.PROFILE, cache_dir=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RematFallbackWarning)
        planned = train(args, device, backend)
    fell_back = [str(w.message) for w in caught if issubclass(w.category, RematFallbackWarning)]
    if rank == 0:
        for report in backend.reports:
            print(report)
    ok = True
    if args.check:
        torch._dynamo.reset()
        reference = train(args, device, None)
        found = differences(planned, reference, args.atol) + fell_back
        tolerance = "bitwise" if args.atol == 0 else f"within {args.atol:g}"
        print(f"rank {rank}: {len(planned[0])} losses and {len(planned[1])} parameters after {args.steps} steps "
              + (f"match {args.engine} without remat ({tolerance})" if not found else "DIFFER: " + "; ".join(found[:5])),
              flush=True)
        failed = torch.tensor([0 if not found else 1], device=device)
        dist.all_reduce(failed)  # every rank exits with the same status
        ok = int(failed.item()) == 0
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    status = main()
    # FSDP2's DTensor caches keep the process group, and with it gloo's worker threads, alive
    # after destroy_process_group(); tearing them down while the interpreter shuts down can abort
    # the process after the work is done (PyTorch 2.13, seen on loaded machines). Everything is
    # written and every rank agreed on the status: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
