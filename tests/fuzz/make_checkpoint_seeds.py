#!/usr/bin/env python3
"""Writes fuzz_checkpoint's seed corpus (tests/fuzz/corpus/checkpoint/) for the configurations
fuzz_checkpoint.cpp reads against, in the format of src/train/checkpoint.hpp (version 6, and
versions 5, 4 and 3, which are still read, little endian). Each seed is one mode byte (bit 0: the fuzzer
recomputes the checksum; bit 1: read against the model with experts, else the dense one) and a
file: the valid checkpoints, then one of each problem the reader must refuse. Usage:
  python3 tests/fuzz/make_checkpoint_seeds.py [folder]
"""

import math
import pathlib
import struct
import sys


def bits(x):  # a float's bits as the reader's int64 field (int32, sign extended)
    return struct.unpack("<i", struct.pack("<f", x))[0]


def bits64(x):  # a double's bits as the reader's int64 field
    return struct.unpack("<q", struct.pack("<d", x))[0]


# checkpoint_seed_configs.hpp's kDense: ModelConfig{layers 1, dim 8, heads 2, kv_heads 1} (ffn 0 -> 32),
# 3 parameters, OptimConfig's defaults, seed 1, fp32 attention, seq_len 64, data hash 0x1234abcd,
# micro 2 (version 6).
# MODEL: the fields before the mixture of experts' (vocab .. alibi); REST: after them and dropout (lr ..).
MODEL = [257, 1, 8, 2, 1, 32, bits(10000.0), bits(1e-5), 3, -1, -1, bits(0.0), 0]
REST = [bits(5e-4), 10, bits(0.1), bits(1.0), bits(0.9), bits(0.95), bits(1e-8), 1, 0, 64, 0x1234abcd]
# Without experts versions 4 and 5 record the seven MoE fields as 0; version 3 has none of them.
# Version 5 adds dropout (a float's bits; 0: off) after them, version 6 micro after REST (and
# the skipped steps after the state's data epoch).
MICRO = 2
DENSE = MODEL + [0] * 7 + [bits(0.0)] + REST + [MICRO]
DENSE_V5 = MODEL + [0] * 7 + [bits(0.0)] + REST
DENSE_V4 = MODEL + [0] * 7 + REST
DENSE_V3 = MODEL + REST
# checkpoint_seed_configs.hpp's kMoe: kDense with experts 4, top_k 2, the softmax router (0), capacity
# factor 1.25, drop by probability (1), aux_loss_coeff 0.01, bias_update_rate 1e-3 (the default).
MOE_FIELDS = [4, 2, 0, bits64(1.25), 1, bits64(0.01), bits64(1e-3)]
MOE = MODEL + MOE_FIELDS + [bits(0.0)] + REST + [MICRO]
DROPOUT = len(MODEL) + 7  # dropout's index in a version 5 or 6 file's fields
LR = DROPOUT + 1  # lr's


def fnv1a64(data, h=14695981039346656037):
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h


def checkpoint(fields=None, state=None, payload=None, version=6, checksum=None):
    """state: (step, data doc, offset, epoch), and in version 6 the skipped steps (0 unless given)."""
    fields = DENSE if fields is None else fields
    state = state if state is not None else (5, 0, 17, 0) + ((0,) if version >= 6 else ())
    payload = payload if payload is not None else [0.5, -1.25, 2.0, 0.01, -0.02, 0.03, 1e-4, 0.0, 2e-3]
    head = struct.pack("<2q", version, len(fields) + len(state)) + struct.pack(f"<{len(fields) + len(state)}q",
                                                                               *fields, *state)
    body = struct.pack(f"<{len(payload)}f", *payload)
    h = fnv1a64(body, fnv1a64(head)) if checksum is None else checksum
    return b"CPATTNTR" + head + struct.pack("<Q", h) + body


def seeds():
    good = checkpoint()
    lr = list(DENSE)
    lr[LR] = bits(1e-3)
    softmax_to_sigmoid = list(MOE)
    softmax_to_sigmoid[len(MODEL) + 2] = 1
    dropout = list(DENSE)
    dropout[DROPOUT] = bits(0.25)
    yield "valid", b"\0" + good
    yield "valid_fix", b"\1" + good
    yield "valid_v3", b"\0" + checkpoint(fields=DENSE_V3, version=3)
    yield "valid_v4", b"\0" + checkpoint(fields=DENSE_V4, version=4)
    yield "valid_v5", b"\0" + checkpoint(fields=DENSE_V5, version=5)
    yield "valid_skipped", b"\0" + checkpoint(state=(5, 0, 17, 0, 2))
    yield "valid_no_micro", b"\0" + checkpoint(fields=DENSE[:-1] + [0])  # micro not recorded
    yield "valid_moe", b"\2" + checkpoint(fields=MOE)
    yield "truncated", b"\0" + good[:-5]
    yield "header_only", b"\0" + good[:8 + 8 * (2 + len(DENSE) + 5) + 8]
    yield "trailing", b"\0" + good + b"\0\0\0\0"
    yield "bad_checksum", b"\0" + checkpoint(checksum=1)
    yield "version1", b"\1" + checkpoint(version=1)
    yield "version2", b"\1" + checkpoint(fields=DENSE_V3, version=2)
    yield "v3_count_of_v4", b"\1" + checkpoint(fields=DENSE_V4, version=3)  # a version 3 file with version 4's fields
    yield "v4_count_of_v5", b"\1" + checkpoint(fields=DENSE_V5, version=4)  # a version 4 file with version 5's fields
    yield "v5_count_of_v6", b"\1" + checkpoint(state=(5, 0, 17, 0, 0), version=5)  # version 5 with version 6's fields
    yield "other_micro", b"\1" + checkpoint(fields=DENSE[:-1] + [3])
    yield "skipped_past_step", b"\1" + checkpoint(state=(5, 0, 17, 0, 6))
    yield "other_lr", b"\1" + checkpoint(fields=lr)
    yield "other_dropout", b"\1" + checkpoint(fields=dropout)
    yield "moe_other_router", b"\3" + checkpoint(fields=softmax_to_sigmoid)
    yield "dense_against_moe", b"\3" + checkpoint(fields=DENSE_V3, version=3)
    yield "negative_step", b"\1" + checkpoint(state=(-1, 0, 0, 0, 0))
    yield "nan_weight", b"\1" + checkpoint(payload=[0.5, math.nan, 2.0, 0, 0, 0, 0, 0, 0])
    yield "negative_moment", b"\1" + checkpoint(payload=[0.5, 1.0, 2.0, 0, 0, 0, 0, -1.0, 0])
    yield "not_a_checkpoint", b"\0" + b"\x93NUMPY\x01\x00"


def main():
    out = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).with_name("corpus") / "checkpoint")
    out.mkdir(parents=True, exist_ok=True)
    for name, data in seeds():
        (out / name).write_bytes(data)


if __name__ == "__main__":
    main()
