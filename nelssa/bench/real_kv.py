"""Sparse attention on real KV: SmolLM2's post-RoPE Q/K/V for a real-text prompt, captured through
transformers' attention-function registry, scored against dense attention.

For each chosen layer and each of the last ``n_queries`` positions t (as decode queries over
keys[:t+1]): the window (first ``sink`` tokens and tokens from L - n_queries - recent on) is attended
exactly, the middle through clusters at a budget, merged by LSE, and compared with dense attention.
Also reports the recall of the true top-``top`` middle tokens of each query head.

    python -m nelssa.bench.real_kv [--tokens 6000] [--out results.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from nelssa.sparse import cluster_kv, dense_attention, merge_states, select_clusters, sparse_attention


def capture_qkv(model_dir: str, n_tokens: int, layers: list[int], dtype=torch.float32, offset_chars: int = 0,
                ids: list[int] | None = None):
    """Run the prompt (n_tokens of real text, or `ids`) once; return
    ({layer: (q [Hq, L, D], k [H, L, D], v [H, L, D])}, tokenizer)."""
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from nelssa.bench.corpus import text_of_tokens

    grabbed: dict[int, tuple] = {}

    def capture(module, query, key, value, attention_mask, **kw):
        i = module.layer_idx
        if i in layers:
            grabbed[i] = (query[0].detach().clone(), key[0].detach().clone(), value[0].detach().clone())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("nelssa_capture", capture)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="nelssa_capture")
    if ids is None:
        text = text_of_tokens(tok, n_tokens, offset_chars)
        x = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :n_tokens]
    else:
        x = torch.tensor([ids])
    with torch.no_grad():
        model(x)
    return grabbed, tok


def evaluate(qkv: dict[int, tuple], budgets=(0.02, 0.04, 0.10), n_queries: int = 8, sink: int = 16,
             recent: int = 64, top: int = 32) -> dict:
    res: dict = {str(b): {"rel_err": [], "rel_err_no_window": [], "recall": []} for b in budgets}
    for layer, (q, k, v) in sorted(qkv.items()):
        Hq, L, D = q.shape
        H = k.shape[0]
        G = Hq // H
        lo, hi = sink, L - n_queries - recent  # middle (host) tokens [lo, hi)
        ckv = cluster_kv(k[:, lo:hi].contiguous(), v[:, lo:hi].contiguous())
        ckv_all = cluster_kv(k.contiguous(), v.contiguous())
        for t in range(L - n_queries, L):
            qt = q[:, t]
            ref, _ = dense_attention(qt, k[:, :t + 1], v[:, :t + 1])
            win_idx = torch.cat([torch.arange(0, lo), torch.arange(hi, t + 1)])
            wo, wl = dense_attention(qt, k[:, win_idx], v[:, win_idx])
            # true top middle tokens per query head
            s = torch.einsum("hgd,hld->hgl", qt.double().view(H, G, D), k[:, lo:hi].double()).reshape(Hq, -1)
            true_top = s.topk(min(top, hi - lo), dim=-1).indices
            for b in budgets:
                so, sl = sparse_attention(qt, ckv, b)
                out, _ = merge_states(wo.float(), wl.float(), so, sl)
                res[str(b)]["rel_err"].append(float((out.double() - ref).norm() / ref.norm()))
                nw, _ = sparse_attention(qt, ckv_all, b)
                res[str(b)]["rel_err_no_window"].append(float((nw.double() - ref).norm() / ref.norm()))
                sel = select_clusters(qt.unsqueeze(0), [ckv], b)
                ids, n = sel.ids[0], sel.counts[0]
                rec = []
                for h in range(H):
                    chosen = ids[h, :n[h]]
                    toks = torch.zeros(hi - lo, dtype=torch.bool)
                    for c in chosen.tolist():
                        st, sz = int(ckv.cstart[h, c]), int(ckv.csize[h, c])
                        toks[ckv.perm[h, st:st + sz]] = True
                    for g in range(G):
                        rec.append(float(toks[true_top[h * G + g]].float().mean()))
                res[str(b)]["recall"].append(sum(rec) / len(rec))
    summary = {}
    for b, r in res.items():
        summary[b] = {k: {"mean": sum(x) / len(x), "max": max(x), "min": min(x)} for k, x in r.items()}
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=6000)
    ap.add_argument("--layers", default="2,9,16,23,29")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    from nelssa.models import prepare_smollm2
    qkv, _ = capture_qkv(str(prepare_smollm2()), a.tokens, [int(x) for x in a.layers.split(",")])
    summary = evaluate(qkv)
    print(json.dumps(summary, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"tokens": a.tokens, "layers": a.layers, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
