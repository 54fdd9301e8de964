"""The catch-up drafter's extended first pass (pipeline.vllm_spec.catch_up_draft): a step's
draft inputs with the positions each caught-up row missed put before its own, their token ids
from the request's committed tokens, their slots from its block table and, for an EAGLE head,
the target's hidden states kept since it skipped."""

from __future__ import annotations

import numpy as np
import torch


def hidden_from(drafter, req_id: str, first: int, start: int, like: torch.Tensor):
    """The kept target hidden states of positions [first, start): later chunks overwrite
    earlier ones (a rejected draft's position is processed again)."""
    out = torch.zeros(start - first, like.shape[-1], dtype=like.dtype)
    for chunk_start, chunk in drafter.missed_hidden.get(req_id, []):
        lo, hi = max(chunk_start, first), min(chunk_start + len(chunk), start)
        if lo < hi:
            out[lo - first : hi - first] = chunk[lo - chunk_start : hi - chunk_start]
    return out


def with_missed(drafter, req_ids, starts, caught, token_ids, positions, hidden, to_sample, cad):
    """The step's inputs with the missed positions of each request in ``caught`` put before
    its own (a request left behind keeps this step's hidden states for its catch-up)."""
    token_ids_cpu = drafter.runner.input_batch.token_ids_cpu
    loc = cad.query_start_loc_cpu.to(torch.int64).tolist()
    reads_hidden = drafter.pass_hidden_states_to_model
    ids_parts, pos_parts, hid_parts, lens, added = [], [], [], [], []
    for i, req_id in enumerate(req_ids):
        start = int(starts[i])
        first = min(drafter.missed_from.get(req_id, start), start) if req_id in caught else start
        if reads_hidden and req_id not in caught and req_id in drafter.missed_from:
            chunk = hidden[loc[i] : loc[i + 1]].to("cpu", copy=True)
            drafter.missed_hidden.setdefault(req_id, []).append((start, chunk))
        if first < start:
            ids_parts.append(torch.from_numpy(token_ids_cpu[i, first:start].astype(np.int64)))
            pos_parts.append(torch.arange(first, start, dtype=torch.int64))
            if reads_hidden:
                hid_parts.append(hidden_from(drafter, req_id, first, start, hidden))
        ids_parts.append(token_ids[loc[i] : loc[i + 1]].cpu().to(torch.int64))
        pos_parts.append(positions[loc[i] : loc[i + 1]].cpu().to(torch.int64))
        if reads_hidden:
            hid_parts.append(hidden[loc[i] : loc[i + 1]].cpu())
        lens.append(start - first + loc[i + 1] - loc[i])
        added.append(start - first)
    drafter._count(caught_up=sum(added))
    device = token_ids.device
    new_ids = torch.cat(ids_parts).to(device=device, dtype=token_ids.dtype)
    new_pos = torch.cat(pos_parts)
    new_hidden = torch.cat(hid_parts).to(device=device) if reads_hidden else hidden
    query_start = torch.zeros(len(lens) + 1, dtype=cad.query_start_loc_cpu.dtype)
    query_start[1:] = torch.cumsum(torch.tensor(lens), 0)
    # Slots of every position from the request's block table (vLLM's first pass
    # recomputes them for a draft model; an EAGLE head takes these as they are).
    rows = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    table = cad.block_table_tensor.cpu()
    block = table[rows, new_pos // drafter.block_size].to(torch.int64)
    slots = block * drafter.block_size + new_pos % drafter.block_size
    if to_sample is not None:  # the sampled index of each row moves by what it gained
        shift = torch.cumsum(torch.tensor(added), 0).to(to_sample.device, to_sample.dtype)
        to_sample = to_sample + shift
    new_cad = cad.replace(
        query_start_loc=query_start.to(cad.query_start_loc.device),
        query_start_loc_cpu=query_start,
        num_actual_tokens=int(query_start[-1]),
        max_query_len=max(lens),
        slot_mapping=slots.to(device=cad.slot_mapping.device, dtype=cad.slot_mapping.dtype),
        positions=None if cad.positions is None else new_pos.to(cad.positions.device),
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )
    new_pos = new_pos.to(device=device, dtype=positions.dtype)
    return new_ids, new_pos, new_hidden, to_sample, new_cad
