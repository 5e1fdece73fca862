"""A small PyTorch transformer trained on packed documents with cpattn.ContextParallelAttention.

The data are the training example's (docs/training.md): the files of /usr/share/common-licenses
(or --data FILES), bytes 0..255 plus an end-of-document token 256, packed into sequences of
--seq-len tokens with their own cu_seqlens. Each rank holds its planner chunks of every
sequence (get_batch_on_this_cp_rank); token-wise layers run on local rows, attention runs
across the ranks, and the gradients are summed over them. CP=1 and CP=2 print the same loss:

    python examples/train_packed.py --steps 5
    mpirun -np 2 python examples/train_packed.py --steps 5
    mpirun -np 2 python examples/train_packed.py --steps 5 --scheme hybrid --cp-inner 2
    mpirun -np 2 python examples/train_packed.py --steps 5 --split padding-free
    mpirun -np 2 python examples/train_packed.py --steps 5 --torch-group    # over a gloo process group

--scheme is any of the C++ layer's (allgather, ring, pass-q, a2a, hybrid with --cp-inner; a2a
and hybrid split the heads, so --heads and --kv-heads must suit the group size: docs/cp.md).
--torch-group initialises torch.distributed (gloo, env:// from mpirun's ranks) and hands the
module its process group in place of the mpi4py communicator (docs/python.md).
"""

import argparse
import os
import pathlib

import numpy as np
import torch
from mpi4py import MPI

import cpattn

EOD, VOCAB = 256, 257


def documents(paths):
    files = sorted(p for path in paths for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file())
    return [np.frombuffer(f.read_bytes(), dtype=np.uint8).astype(np.int64) for f in files if f.stat().st_size]


def packed_batches(docs, seq_len):
    """Sequences of seq_len tokens from the stream of documents (each ends with EOD); a document
    cut by the sequence's end goes on as a new segment in the next one."""
    stream = [np.append(d, EOD) for d in docs]
    d, offset = 0, 0
    while True:
        tokens, labels, cu = [], [], [0]
        while cu[-1] < seq_len:
            doc = stream[d]
            take = min(len(doc) - offset, seq_len - cu[-1])
            seg = doc[offset:offset + take]
            nxt = doc[offset + 1:offset + take + 1]
            tokens.append(seg)
            labels.append(np.append(nxt, [cpattn.IGNORE_INDEX] * (take - len(nxt))))  # EOD has no label
            cu.append(cu[-1] + take)
            offset += take
            if offset == len(doc):
                d, offset = (d + 1) % len(stream), 0
        tokens, labels = np.concatenate(tokens), np.concatenate(labels)
        positions = np.concatenate([np.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
        yield {"tokens": tokens, "labels": labels, "position_ids": positions,
               "loss_mask": (labels != cpattn.IGNORE_INDEX).astype(np.float32)}, np.array(cu)


class Block(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, attn):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.wq = torch.nn.Linear(dim, dim, bias=False)
        self.wkv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)
        self.wo = torch.nn.Linear(dim, dim, bias=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.attn = attn

    def forward(self, x, cu_seqlens):
        h = self.norm1(x)
        q = self.wq(h).view(-1, self.heads, self.head_dim)
        k, v = self.wkv(h).view(-1, 2, self.kv_heads, self.head_dim).unbind(1)
        x = x + self.wo(self.attn(q, k, v, cu_seqlens).reshape(x.shape))
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self, comm, args):
        super().__init__()
        attn = cpattn.ContextParallelAttention(comm, scheme=args.scheme, cp_inner=args.cp_inner, split=args.split,
                                               causal=True)
        self.wte = torch.nn.Embedding(VOCAB, args.dim)
        self.wpe = torch.nn.Embedding(2 * args.seq_len, args.dim)  # padding continues positions
        self.blocks = torch.nn.ModuleList(Block(args.dim, args.heads, args.kv_heads, attn) for _ in range(args.layers))
        self.head = torch.nn.Linear(args.dim, VOCAB, bias=False)

    def forward(self, tokens, positions, cu_seqlens):
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        return self.head(x)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--scheme", default="allgather", help="allgather, ring, pass-q, a2a or hybrid")
    p.add_argument("--cp-inner", type=int, default=None, help="--scheme hybrid: ranks of one all-to-all group")
    p.add_argument("--split", default="padded", help="padded or padding-free (the latter: --scheme allgather)")
    p.add_argument("--torch-group", action="store_true",
                   help="run attention over a torch.distributed gloo group made from mpirun's ranks")
    p.add_argument("--data", type=pathlib.Path, nargs="+", default=[pathlib.Path("/usr/share/common-licenses")])
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    group = comm
    if args.torch_group:  # Open MPI's ranks, and a port rank 0 picked
        import socket
        import torch.distributed as dist
        port = None
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(comm.bcast(port, root=0)))
        dist.init_process_group("gloo", init_method="env://", rank=comm.rank, world_size=comm.size)
        group = dist.group.WORLD
    torch.manual_seed(0)  # the same initial model on every rank
    model = Model(group, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    batches = packed_batches(documents(args.data), args.seq_len)
    for step in range(args.steps):
        batch, cu = next(batches)
        local = cpattn.get_batch_on_this_cp_rank(batch, cu, comm.size, comm.rank, split=args.split)
        logits = model(local["tokens"], local["position_ids"], torch.from_numpy(cu))
        # The loss over the real tokens of all ranks: each rank's sum over the global count.
        count = float(batch["loss_mask"].sum())
        loss = torch.nn.functional.cross_entropy(logits, local["labels"], reduction="sum") / count
        opt.zero_grad()
        loss.backward()
        for param in model.parameters():  # sum the ranks' gradients (in place)
            comm.Allreduce(MPI.IN_PLACE, param.grad.numpy(), op=MPI.SUM)
        opt.step()
        total = comm.allreduce(loss.item(), op=MPI.SUM)
        if comm.rank == 0:
            print(f"step {step}  loss {total:.5f}", flush=True)
    if args.torch_group:  # stop gloo's threads before the interpreter (a running one can abort its exit)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
