#!/usr/bin/python3
"""The PyTorch twin of examples/bert (cohort's BERT-style masked-LM pretraining on WordNet's glosses):
the same model, initialisation, data, vocabulary, masking, sampler, batch and threads, in Python
PyTorch with DistributedDataParallel (gloo), for side-by-side runs (bench/bench_bert.sh).

One process:
    /usr/bin/python3 bench/bert_twin.py --max-steps 50
Two processes, DDP over gloo (Debian's torchrun crashes on Python 3.11: use the peers' wrapper):
    GLOO_SOCKET_IFNAME=lo /usr/bin/python3 bench/peers/torchrun311.py --nproc_per_node 2 \\
        --master_addr 127.0.0.1 --master_port 29711 bench/bert_twin.py --max-steps 50
Options that mirror the example's: --size mini|small|base (and --layers/--hidden/--heads/--seq-len/
--vocab), --batch, --lr, --weight-decay, --dropout, --optimizer adamw|adam|sgd, --zero 0|1
(1: torch.distributed.optim.ZeroRedundancyOptimizer, PyTorch's sharded optimizer state),
--comm-hook none|fp16 (DDP's fp16_compress_hook from torch.distributed.algorithms.ddp_comm_hooks.default_hooks,
registered with register_comm_hook(None, ...); --compression fp16 is its older spelling; no bf16: torch 1.13's
DDP refuses bf16_compress_hook without CUDA, "BF16 all reduce communication hook required CUDA 11+ and NCCL
2.10+"), --bucket-mb, --max-steps, --train-samples,
--test-samples, --seed, --threads (default 1), --print-digest, --device cpu|cuda (cuda: this rank's GPU, DDP over
NCCL even on one rank, as resnet_twin.py). The output lines are the example's, so the same
greps read both.
--fsdp (torch 2.x: Debian 13's 2.6, bench/peers/run_torch_fsdp.sh): PyTorch's FullyShardedDataParallel on the
CPU over gloo instead of DDP, as examples/bert --fsdp cuts the model: every encoder layer a unit
(ModuleWrapPolicy), the embeddings tied to the decoder and the head in the root; reshard after forward
(FULL_SHARD) and backward prefetch of the unit before, as cohort's defaults.
"""
import argparse
import os
import re
import resource
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

WORDNET = "/usr/share/wordnet"
PAD, UNK, CLS, SEP, MASK, FIRST_WORD = 0, 1, 2, 3, 4, 5
SIZES = {"mini": (2, 128, 4, 32, 8000), "small": (4, 256, 4, 48, 16000), "base": (12, 768, 12, 64, 30000)}
M64 = (1 << 64) - 1
TOKEN = re.compile(rb"[a-z0-9\x80-\xff]+|[^\sa-z0-9\x80-\xff]")


# ---- data: examples/dataset/wordnet_glosses.h, line for line ----
def read_glosses(folder):
    glosses = []
    for part in ("noun", "verb", "adj", "adv"):
        with open(os.path.join(folder, "data." + part), "rb") as f:
            for line in f.read().split(b"\n"):
                if not line or line[:1] == b" ":
                    continue
                bar = line.find(b" | ")
                if bar < 0:
                    continue
                glosses.append(line[bar + 3:].rstrip(b" \r"))
    return glosses


def tokenize(text):
    return TOKEN.findall(text.lower())


def build_vocabulary(texts, size):
    counts = {}
    for t in texts:
        for w in t:
            counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    words = [b"[PAD]", b"[UNK]", b"[CLS]", b"[SEP]", b"[MASK]"] + [w for w, _ in ranked[: max(0, size - 5)]]
    return {w: i for i, w in enumerate(words)}


def encode(tokens, vocab, length):
    ids = [PAD] * length
    ids[0] = CLS
    n = min(len(tokens), length - 2)
    for i in range(n):
        ids[i + 1] = vocab.get(tokens[i], UNK)
    ids[n + 1] = SEP
    return ids


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def mask_draw(seed, epoch, sample, position, draw):
    h = splitmix64(splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ sample) ^ ((position * 4 + draw) & M64))
    return (h >> 11) * (1.0 / 9007199254740992.0)


def mask_tokens(ids, vocab_size, seed, epoch, sample):
    labels = [-100] * len(ids)
    any_masked = False
    p = 1
    while p < len(ids) and ids[p] not in (SEP, PAD):
        if mask_draw(seed, epoch, sample, p, 0) < 0.15:
            labels[p] = ids[p]
            any_masked = True
            how = mask_draw(seed, epoch, sample, p, 1)
            if how < 0.8:
                ids[p] = MASK
            elif how < 0.9:
                ids[p] = FIRST_WORD + int(mask_draw(seed, epoch, sample, p, 2) * float(vocab_size - FIRST_WORD))
        p += 1
    if not any_masked and len(ids) > 2 and ids[1] != SEP:
        labels[1] = ids[1]
        ids[1] = MASK
    return labels


def make_batch(data, indices, seq_len, vocab_size, seed, epoch):
    ids, masked, labels = [], [], []
    for i, sample in enumerate(indices):
        seq = list(data[sample])
        lab = mask_tokens(seq, vocab_size, seed, epoch, sample)
        for p in range(seq_len):
            if lab[p] >= 0:
                masked.append(i * seq_len + p)
                labels.append(lab[p])
        ids.extend(seq)
    return (torch.tensor(ids, dtype=torch.long).view(len(indices), seq_len), torch.tensor(masked, dtype=torch.long),
            torch.tensor(labels, dtype=torch.long))


# ---- the model: examples/bert/bert.cc's, modules constructed in the same order ----
class EncoderLayer(nn.Module):
    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, bias):
        b, l, h = x.shape
        d = h // self.heads
        qkv = self.qkv(x).view(b, l, 3, self.heads, d).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(qkv[0], qkv[1].transpose(-2, -1)) / (d ** 0.5) + bias
        context = torch.matmul(self.drop(torch.softmax(scores, -1)), qkv[2]).transpose(1, 2).reshape(b, l, h)
        y = self.ln1(x + self.drop(self.out(context)))
        return self.ln2(y + self.drop(self.fc2(F.gelu(self.fc1(y)))))


class Bert(nn.Module):
    def __init__(self, layers, hidden, heads, seq_len, vocab, dropout):
        super().__init__()
        self.tokens = nn.Embedding(vocab, hidden)
        self.positions = nn.Embedding(seq_len, hidden)
        self.ln = nn.LayerNorm(hidden, eps=1e-12)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList()
        self.transform = nn.Linear(hidden, hidden)
        self.ln_head = nn.LayerNorm(hidden, eps=1e-12)
        for _ in range(layers):
            self.layers.append(EncoderLayer(hidden, heads, dropout))
        self.decoder_bias = nn.Parameter(torch.zeros(vocab))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if "ln" in name:
                    p.fill_(1.0 if len(name) > 6 and name.endswith("weight") else 0.0)
                elif len(name) > 4 and name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)

    def forward(self, ids, masked):
        l = ids.shape[1]
        pos = torch.arange(l, dtype=ids.dtype, device=ids.device)
        x = self.drop(self.ln(self.tokens(ids) + self.positions(pos).unsqueeze(0)))
        bias = ids.eq(PAD).to(x.dtype).mul(-1e9).view(ids.shape[0], 1, 1, l)
        for layer in self.layers:
            x = layer(x, bias)
        h = x.reshape(-1, x.shape[2]).index_select(0, masked)
        h = self.ln_head(F.gelu(self.transform(h)))
        return torch.matmul(h, self.tokens.weight.t()) + self.decoder_bias


def digest(model):
    h = 1469598103934665603
    for p in model.parameters():
        for b in p.detach().cpu().contiguous().numpy().tobytes():
            h = ((h ^ b) * 1099511628211) & M64
    return h


def state_bytes(opt):
    total = 0
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.numel() > 1:
                total += v.numel() * v.element_size()
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="mini", choices=sorted(SIZES))
    for flag in ("layers", "hidden", "heads", "seq-len", "vocab"):
        ap.add_argument("--" + flag, type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adam", "sgd"])
    ap.add_argument("--zero", type=int, default=0, choices=[0, 1])
    ap.add_argument("--comm-hook", default="none", choices=["none", "fp16"],
                    help="DDP communication hook: fp16 puts the gradients on the wire as fp16 (fp16_compress_hook)")
    ap.add_argument("--compression", default="none", choices=["none", "fp16"], help="old spelling of --comm-hook")
    ap.add_argument("--bucket-mb", type=float, default=25)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--train-samples", type=int, default=0)
    ap.add_argument("--test-samples", type=int, default=0)
    ap.add_argument("--data-dir", default=WORDNET)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--print-digest", action="store_true")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: this rank's GPU (LOCAL_RANK), NCCL, DDP even on 1 rank (as the C++ example)")
    a = ap.parse_args()
    if a.fsdp and (a.zero or a.comm_hook != "none" or a.compression != "none" or a.print_digest):
        ap.error("--fsdp shards the parameters, gradients and optimizer state itself: no --zero, --comm-hook or --print-digest")
    if a.compression != "none":
        if a.comm_hook not in ("none", a.compression):
            ap.error(f"--compression {a.compression} and --comm-hook {a.comm_hook} disagree")
        a.comm_hook = a.compression
    layers, hidden, heads, seq_len, vocab_size = SIZES[a.size]
    layers, hidden, heads = a.layers or layers, a.hidden or hidden, a.heads or heads
    seq_len, vocab_size = a.seq_len or seq_len, a.vocab or vocab_size

    glosses = read_glosses(a.data_dir)
    train_tokens = [tokenize(g) for i, g in enumerate(glosses) if i % 20 != 19]
    test_tokens = [tokenize(g) for i, g in enumerate(glosses) if i % 20 == 19]
    if 0 < a.train_samples < len(train_tokens):
        train_tokens = train_tokens[: a.train_samples]
    vocab = build_vocabulary(train_tokens, vocab_size)
    vocab_size = len(vocab)
    train = [encode(t, vocab, seq_len) for t in train_tokens]
    test = [encode(t, vocab, seq_len) for t in test_tokens]

    distributed = "RANK" in os.environ
    cuda = a.device == "cuda"
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = Bert(layers, hidden, heads, seq_len, vocab_size, a.dropout).to(device)
    nparams = sum(p.numel() for p in model.parameters())
    if a.print_digest and rank == 0:
        print(f"initial weights digest: {digest(model):016x}", flush=True)
    ddp = model
    if distributed and a.fsdp:
        from torch.distributed.fsdp import BackwardPrefetch, FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        ddp = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({EncoderLayer}),
                                       sharding_strategy=ShardingStrategy.FULL_SHARD,
                                       backward_prefetch=BackwardPrefetch.BACKWARD_PRE, device_id=torch.device("cpu"))
    elif distributed:
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None,
                                                  bucket_cap_mb=a.bucket_mb)
        if a.comm_hook != "none":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    kinds = {"sgd": (torch.optim.SGD, dict(lr=a.lr, momentum=0.9, weight_decay=a.weight_decay)),
             "adam": (torch.optim.Adam, dict(lr=a.lr, weight_decay=a.weight_decay)),
             "adamw": (torch.optim.AdamW, dict(lr=a.lr, weight_decay=a.weight_decay))}
    cls, kw = kinds[a.optimizer]
    if a.zero and distributed:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=cls, **kw)
    else:
        opt = cls(ddp.parameters(), **kw)
    sampler = torch.utils.data.DistributedSampler(range(len(train)), num_replicas=world, rank=rank, shuffle=True,
                                                  seed=a.seed)
    if rank == 0:
        print(f"bert twin: {layers} layers, hidden {hidden}, {heads} heads, sequence {seq_len}, vocabulary "
              f"{vocab_size}: {nparams} parameters; {len(train)} training and {min(a.test_samples, len(test)) if a.test_samples > 0 else len(test)} held-out glosses; world "
              f"{world}, batch {a.batch} per rank, {a.optimizer}{' ZeroRedundancyOptimizer' if a.zero else ''}"
              f"{' fully sharded (PyTorch FSDP)' if distributed and a.fsdp else ''}"
              f"{f', {a.comm_hook}_compress_hook' if distributed and a.comm_hook != 'none' else ''}",
              flush=True)
    if distributed:
        dist.barrier()
    t0 = time.perf_counter()
    samples = steps_run = 0
    stop = False
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        indices = list(sampler)
        steps = (len(indices) + a.batch - 1) // a.batch
        for step in range(steps):
            part = indices[step * a.batch:(step + 1) * a.batch]
            ids, masked, labels = make_batch(train, part, seq_len, vocab_size, a.seed, epoch)
            ids, masked, labels = ids.to(device), masked.to(device), labels.to(device)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(ids, masked), labels)
            loss.backward()
            opt.step()
            samples += len(part)
            steps_run += 1
            if rank == 0 and step % 10 == 0:
                print(f"epoch: {epoch}, step: {step}/{steps}, loss: {loss.item():.4f}", flush=True)
            if a.max_steps and steps_run == a.max_steps:
                stop = True
                break
        if stop:
            break
    if cuda:
        torch.cuda.synchronize(device)  # the host runs ahead of the GPU: its queued steps are part of the run
    if distributed:
        dist.barrier()
    seconds = time.perf_counter() - t0
    model.eval()
    correct = predicted = 0
    loss_sum = 0.0  # summed cross-entropy of the masked tokens, as the C++ example reports it
    with torch.no_grad():
        held_out = min(a.test_samples, len(test)) if a.test_samples > 0 else len(test)
        mine = list(range(rank, held_out, world))
        for i in range(0, len(mine), 256):
            ids, masked, labels = make_batch(test, mine[i:i + 256], seq_len, vocab_size, a.seed, M64)
            ids, masked, labels = ids.to(device), masked.to(device), labels.to(device)
            logits = (ddp if a.fsdp else model)(ids, masked)  # FSDP: the wrapper gathers the units
            correct += logits.argmax(1).eq(labels).sum().item()
            loss_sum += F.cross_entropy(logits, labels, reduction="none").sum(dtype=torch.float64).item()
            predicted += labels.numel()
    totals = torch.tensor([correct, predicted, samples], dtype=torch.long, device=device)  # NCCL: on the GPU
    loss_total = torch.tensor([loss_sum], dtype=torch.float64, device=device)
    memory = torch.tensor([[state_bytes(opt.optim if a.zero and distributed else opt) / 1e6,
                            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0]], dtype=torch.float64,
                          device=device)
    gathered = [memory.clone() for _ in range(world)]
    if distributed:
        dist.all_reduce(totals)
        dist.all_reduce(loss_total)
        dist.all_gather(gathered, memory)
    if rank == 0:
        c, n, total = totals.tolist()
        print(f"masked-token accuracy (held-out): {c / n if n else 0:.4f} ({c} of {n})")
        print(f"masked-token loss (held-out): {loss_total.item() / n if n else 0:.4f}")
        print(f"samples/s: {total / seconds if seconds else 0:.1f} ({total} samples on {world} ranks in {seconds:.3f} s, "
              f"{steps_run} steps per rank)")
        for r, m in enumerate(gathered):
            print(f"rank {r}: optimizer state {m[0][0].item():.1f} MB, peak RSS {m[0][1].item():.1f} MB")
        if a.print_digest:
            print(f"final weights digest: {digest(model):016x}")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
