// bert: masked-language-model pretraining of a BERT-style encoder on WordNet's glosses, data parallel
// with libtorch and cohort::torch::DistributedDataParallel (and, with --zero 1 or 2, the sharded
// optimizer: cohort::torch::ShardedOptimizer).
//
//   cohort run --nproc-per-node 2 build/examples/bert/bert                 the default ("mini") size
//   cohort run --nproc-per-node 2 build/examples/bert/bert --zero 2        the optimizer state sharded
//   cohort run --nproc-per-node 2 build/examples/bert/bert --fsdp          the parameters too (FSDP)
//   build/examples/bert/bert --size base --device cuda                     BERT-base (12 x 768) on a GPU
//   cohort run --gpus-per-node auto build/examples/bert/bert --fsdp --device cuda   FSDP, one GPU a rank (NCCL)
//
// The model is BERT's (Devlin et al. 2019): token and position embeddings, layer norm, N post-norm
// encoder layers (multi-head self-attention, then a GELU MLP of 4x the width), and the masked-LM head
// (dense + GELU + layer norm, then the decoder tied to the token embedding). Only the masked
// positions reach the decoder. The data is examples/dataset/wordnet_glosses.h; bench/bert_twin.py is
// the same model, data and masking in Python PyTorch DDP for side-by-side runs.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <sys/resource.h>
#include <malloc.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "cohort/communicator.h"
#include "cohort/error.h"
#include "cohort/gpu.h"
#include "cohort/torch/ddp.h"
#include "cohort/torch/fsdp.h"
#include "cohort/torch/sharded_optimizer.h"
#include "common/gpu_report.h"
#include "common/launch.h"
#include "common/phase_times.h"
#include "dataset/wordnet_glosses.h"
#include "store/memory_store.h"

namespace nn = torch::nn;
using cohort::examples::kAtLeastOne;
using cohort::examples::kNotNegative;
using cohort::examples::kPositive;
using cohort::examples::launched;
using cohort::ConfigError;

namespace {

struct Size {
  int64_t layers, hidden, heads, seq_len, vocab;
};
// mini: an epoch in minutes on two CPU cores; base: BERT-base's encoder (110 M parameters with a
// 30,000-word vocabulary), for real hardware and the sharded optimizer's memory figures.
Size size_named(const std::string& name) {
  if (name == "base") return {12, 768, 12, 64, 30000};
  if (name == "small") return {4, 256, 4, 48, 16000};
  return {2, 128, 4, 32, 8000};  // mini
}

// ---- the model ----
struct EncoderLayerImpl : nn::Module {
  EncoderLayerImpl(int64_t hidden, int64_t heads, double dropout)
      : heads(heads),
        qkv(register_module("qkv", nn::Linear(hidden, 3 * hidden))),
        out(register_module("out", nn::Linear(hidden, hidden))),
        ln1(register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({hidden}).eps(1e-12)))),
        fc1(register_module("fc1", nn::Linear(hidden, 4 * hidden))),
        fc2(register_module("fc2", nn::Linear(4 * hidden, hidden))),
        ln2(register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({hidden}).eps(1e-12)))),
        drop(register_module("drop", nn::Dropout(dropout))) {}

  // x: [B, L, H]; bias: [B, 1, 1, L], -inf-ish where the key is padding.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& bias) {
    const int64_t b = x.size(0), l = x.size(1), h = x.size(2), d = h / heads;
    auto qkv_ = qkv(x).view({b, l, 3, heads, d}).permute({2, 0, 3, 1, 4});  // 3, B, heads, L, d
    auto scores = torch::matmul(qkv_[0], qkv_[1].transpose(-2, -1)) / std::sqrt(static_cast<double>(d)) + bias;
    auto context = torch::matmul(drop(torch::softmax(scores, -1)), qkv_[2]).transpose(1, 2).reshape({b, l, h});
    auto y = ln1(x + drop(out(context)));
    return ln2(y + drop(fc2(torch::gelu(fc1(y)))));
  }
  int64_t heads;
  nn::Linear qkv, out;
  nn::LayerNorm ln1;
  nn::Linear fc1, fc2;
  nn::LayerNorm ln2;
  nn::Dropout drop;
};
TORCH_MODULE(EncoderLayer);

struct BertImpl : nn::Module {
  BertImpl(const Size& s, double dropout)
      : tokens(register_module("tokens", nn::Embedding(s.vocab, s.hidden))),
        positions(register_module("positions", nn::Embedding(s.seq_len, s.hidden))),
        ln(register_module("ln", nn::LayerNorm(nn::LayerNormOptions({s.hidden}).eps(1e-12)))),
        drop(register_module("drop", nn::Dropout(dropout))),
        layers(register_module("layers", nn::ModuleList())),
        transform(register_module("transform", nn::Linear(s.hidden, s.hidden))),
        ln_head(register_module("ln_head", nn::LayerNorm(nn::LayerNormOptions({s.hidden}).eps(1e-12)))) {
    for (int64_t i = 0; i < s.layers; ++i) layers->push_back(EncoderLayer(s.hidden, s.heads, dropout));
    decoder_bias = register_parameter("decoder_bias", torch::zeros({s.vocab}));
    // BERT's initialisation: N(0, 0.02) weights, zero biases, layer norms at 1 and 0 (in this order
    // in the twin too, so that the same seed gives the same weights).
    torch::NoGradGuard no_grad;
    for (auto& p : named_parameters(true)) {
      const std::string& name = p.key();
      if (name.find("ln") != std::string::npos) p.value().fill_(name.size() > 6 && name.substr(name.size() - 6) == "weight" ? 1.0 : 0.0);
      else if (name.size() > 4 && name.substr(name.size() - 4) == "bias") p.value().zero_();
      else p.value().normal_(0.0, 0.02);
    }
  }

  // ids: [B, L]; masked: flat indices (into B * L) of the positions to predict. Returns their logits.
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& masked) {
    const int64_t l = ids.size(1);
    auto pos = torch::arange(l, ids.options());
    auto x = drop(ln(tokens(ids) + positions(pos).unsqueeze(0)));
    auto bias = ids.eq(cohort::examples::kPad).to(x.scalar_type()).mul(-1e9).view({ids.size(0), 1, 1, l});
    for (const auto& layer : *layers) {
      auto run_layer = [&] { return layer->as<EncoderLayer>()->forward(x, bias); };
      x = around_layer ? around_layer(*layer, run_layer) : run_layer();
    }
    auto h = x.reshape({-1, x.size(2)}).index_select(0, masked);
    h = ln_head(torch::gelu(transform(h)));
    return torch::matmul(h, tokens->weight.t()) + decoder_bias;  // the decoder is the embedding, tied
  }

  nn::Embedding tokens, positions;
  nn::LayerNorm ln;
  nn::Dropout drop;
  nn::ModuleList layers;
  nn::Linear transform;
  nn::LayerNorm ln_head;
  torch::Tensor decoder_bias;
  // --fsdp: each encoder layer runs through FullyShardedDataParallel::unit_forward (its unit gathered).
  std::function<torch::Tensor(nn::Module&, const std::function<torch::Tensor()>&)> around_layer;
};
TORCH_MODULE(Bert);

// ---- data ----
struct Corpus {
  std::vector<std::vector<int64_t>> train, test;  // encoded sequences (unmasked)
  cohort::examples::Vocabulary vocab;
};

// Every 20th gloss is held out; the vocabulary comes from the training glosses only.
Corpus load_corpus(const std::string& dir, const Size& s, int64_t train_samples) {
  auto glosses = cohort::examples::read_wordnet_glosses(dir);
  std::vector<std::vector<std::string>> train_tokens, test_tokens;
  for (size_t i = 0; i < glosses.size(); ++i)
    (i % 20 == 19 ? test_tokens : train_tokens).push_back(cohort::examples::tokenize(glosses[i]));
  if (train_samples > 0 && train_samples < static_cast<int64_t>(train_tokens.size()))
    train_tokens.resize(static_cast<size_t>(train_samples));
  Corpus c;
  c.vocab = cohort::examples::build_vocabulary(train_tokens, s.vocab);
  for (const auto& t : train_tokens) c.train.push_back(cohort::examples::encode(t, c.vocab, s.seq_len));
  for (const auto& t : test_tokens) c.test.push_back(cohort::examples::encode(t, c.vocab, s.seq_len));
  return c;
}

struct Batch {
  torch::Tensor ids, masked, labels;  // [B, L]; flat masked positions; their labels
};
// Samples `indices` of `data`, masked for `epoch`.
Batch make_batch(const std::vector<std::vector<int64_t>>& data, const std::vector<int64_t>& indices, int64_t begin,
                 int64_t len, int64_t seq_len, int64_t vocab, uint64_t seed, uint64_t epoch) {
  std::vector<int64_t> ids, masked, labels;
  ids.reserve(static_cast<size_t>(len * seq_len));
  for (int64_t i = 0; i < len; ++i) {
    const int64_t sample = indices[static_cast<size_t>(begin + i)];
    auto seq = data[static_cast<size_t>(sample)];
    auto lab = cohort::examples::mask_tokens(seq, vocab, seed, epoch, static_cast<uint64_t>(sample));
    for (int64_t p = 0; p < seq_len; ++p)
      if (lab[static_cast<size_t>(p)] >= 0) masked.push_back(i * seq_len + p), labels.push_back(lab[static_cast<size_t>(p)]);
    ids.insert(ids.end(), seq.begin(), seq.end());
  }
  return {torch::tensor(ids, torch::kLong).view({len, seq_len}), torch::tensor(masked, torch::kLong),
          torch::tensor(labels, torch::kLong)};
}

uint64_t weights_digest(const std::vector<torch::Tensor>& parameters) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the bytes of every parameter
  for (auto& p : parameters) {
    auto c = p.detach().to(torch::kCPU).contiguous();
    auto* b = static_cast<const unsigned char*>(c.data_ptr());
    for (size_t i = 0; i < static_cast<size_t>(c.numel()) * c.element_size(); ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  return h;
}

// The optimizer state of an unsharded torch optimizer, in bytes (Adam's moments, SGD's momentum).
size_t state_bytes(torch::optim::Optimizer& opt, const std::string& kind) {
  size_t bytes = 0;
  auto add = [&](const torch::Tensor& t) {
    if (t.defined()) bytes += static_cast<size_t>(t.numel()) * t.element_size();
  };
  for (auto& [key, state] : opt.state()) {
    if (kind == "sgd") {
      add(static_cast<torch::optim::SGDParamState&>(*state).momentum_buffer());
    } else if (kind == "adam") {
      auto& s = static_cast<torch::optim::AdamParamState&>(*state);
      add(s.exp_avg()), add(s.exp_avg_sq()), add(s.max_exp_avg_sq());
    } else {
      auto& s = static_cast<torch::optim::AdamWParamState&>(*state);
      add(s.exp_avg()), add(s.exp_avg_sq()), add(s.max_exp_avg_sq());
    }
  }
  return bytes;
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: kilobytes
}

// This process's resident memory now, from /proc/self/smaps_rollup (Linux): Rss, and Pss, which splits
// each shared page among the processes that map it (the buckets are shared memory the peers map).
// Slow for a big process (it walks every mapping): for --trace-memory only.
std::string memory_now() {
  std::ifstream in("/proc/self/smaps_rollup");
  std::string line;
  double rss = 0, pss = 0, pss_file = 0, pss_shmem = 0, anon = 0;
  auto field = [&](const char* key, double& mb) {  // "Rss:   123456 kB"
    if (line.rfind(key, 0) == 0) mb = std::strtod(line.c_str() + std::strlen(key), nullptr) / 1024.0;
  };
  // Pss_File: libtorch's code and data pages (shared with every process that maps them); Pss_Shmem:
  // the communicator's segments.
  while (std::getline(in, line))
    field("Rss:", rss), field("Pss:", pss), field("Pss_File:", pss_file), field("Pss_Shmem:", pss_shmem),
        field("Anonymous:", anon);
  // What malloc holds for live blocks (heap and mmap'ed: the program's memory without the heap's free
  // holes) and what it keeps free in the heap.
  double heap_free = 0, in_use = 0;
#if defined(__GLIBC__)
  const auto info = mallinfo2();
  heap_free = static_cast<double>(info.fordblks) / (1024.0 * 1024.0);
  in_use = static_cast<double>(info.uordblks + info.hblkhd) / (1024.0 * 1024.0);
#endif
  return fmt::format("Rss {:.0f} MB (peak so far {:.0f}), Pss {:.0f} MB (Pss of files {:.0f}, of shared memory {:.0f}), "
                     "anonymous {:.0f} MB, in use by malloc {:.0f} MB, free in the heap {:.0f} MB",
                     rss, peak_rss_mb(), pss, pss_file, pss_shmem, anon, in_use, heap_free);
}

struct Args {
  std::string size = "mini";
  int64_t layers = 0, hidden = 0, heads = 0, seq_len = 0, vocab = 0;
  int64_t batch = 32;
  double lr = 5e-4;
  double weight_decay = 0.01;
  double dropout = 0.1;
  std::string optimizer = "adamw";
  int zero = 0;
  bool fsdp = false;
  size_t fsdp_mmap_threshold = cohort::torch::FSDPOptions{}.mmap_threshold_bytes;
  int64_t epochs = 1;
  int64_t max_steps = 0;
  int64_t train_samples = 0;
  int64_t test_samples = 0;
  std::string data_dir = cohort::examples::kWordnetDir;
  uint64_t seed = 0;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  bool resume = false;
  std::string compression = "none";
  double bucket_mb = 25;
  std::string device = "cpu";
  int threads = 0;
  bool verbose = false;
  int64_t kill_after_steps = 0;
  bool print_digest = false;
  int64_t trace_memory = 0;
  int64_t trace_phases = 0;
};

int run(const Args& a) {
  auto compression = cohort::train::parse_compression(a.compression);
  if (!compression) throw ConfigError(fmt::format("--compression must be none, fp16 or bf16, not '{}'", a.compression));
  if (a.resume && a.checkpoint_dir.empty()) throw ConfigError("--resume needs --checkpoint-dir");
  if (a.fsdp && (a.zero || *compression != cohort::train::WireCompression::kNone))
    throw ConfigError("--fsdp shards the parameters, gradients and optimizer state itself: it takes neither --zero nor "
                      "--compression");
  Size s = size_named(a.size);
  if (a.layers) s.layers = a.layers;
  if (a.hidden) s.hidden = a.hidden;
  if (a.heads) s.heads = a.heads;
  if (a.seq_len) s.seq_len = a.seq_len;
  if (a.vocab) s.vocab = a.vocab;
  if (s.hidden % s.heads != 0)
    throw ConfigError(fmt::format("--hidden {} is not a multiple of --heads {}", s.hidden, s.heads));
  if (s.seq_len < 3) throw ConfigError(fmt::format("--seq-len must be at least 3, not {}", s.seq_len));
  if (s.vocab <= cohort::examples::kFirstWord) throw ConfigError(fmt::format("--vocab must be above 5, not {}", s.vocab));

  // Data first: a missing corpus fails before any rank waits for another.
  const Corpus corpus = load_corpus(a.data_dir, s, a.train_samples);
#if defined(__GLIBC__)
  // Parsing WordNet leaves about 85 MB of freed heap behind (BERT-base's corpus), which glibc keeps
  // resident: every mode would carry it, and the memory before the model (bench/fsdp_memory.sh's B)
  // would count holes that FSDP's and the sharded optimizer's first malloc_trim hand back.
  malloc_trim(0);
#endif
  const int64_t vocab = corpus.vocab.size();  // the corpus may have fewer words than asked for
  s.vocab = vocab;

  std::shared_ptr<cohort::Communicator> comm =
      launched() ? cohort::Communicator::from_env() : cohort::Communicator::create(cohort::make_memory_store(), 0, 1);
  const int rank = comm->rank(), world = comm->size();
  const bool lead = rank == 0;
  const int threads = a.threads > 0 ? a.threads : (comm->local_size() > 1 ? 1 : torch::get_num_threads());
  torch::set_num_threads(threads);
  torch::Device device(torch::kCPU);
  if (a.device == "cuda") {
    if (!torch::cuda::is_available())
      throw ConfigError("--device cuda: this libtorch has no CUDA, or sees no GPU (torch::cuda::is_available() is false)");
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(cohort::gpu::local_device()));
  } else if (a.device != "cpu") {
    throw ConfigError(fmt::format("--device must be cpu or cuda, not '{}'", a.device));
  }

  // The process without the model (libtorch, the corpus, the communicator): what the memory figures
  // of bench/fsdp_memory.sh subtract.
  if (a.trace_memory > 0) fmt::print("rank {} before the model: {}\n", rank, memory_now());
  torch::manual_seed(a.seed);
  Bert model(s, a.dropout);
  model->to(device);
  cohort::torch::DDPOptions ddp_options;
  ddp_options.compression = *compression;
  ddp_options.bucket_cap_bytes = static_cast<size_t>(a.bucket_mb * 1024 * 1024);
  // The sharded optimizer's buckets define its shards: they are not rebuilt in ready order anyway.
  // --fsdp: every encoder layer a unit; the embeddings (tied to the decoder) and the head form the root.
  std::unique_ptr<cohort::torch::DistributedDataParallel> ddp;
  std::unique_ptr<cohort::torch::FullyShardedDataParallel> fsdp;
  if (a.fsdp) {
    std::vector<std::shared_ptr<nn::Module>> units(model->layers->begin(), model->layers->end());
    cohort::torch::FSDPOptions fsdp_options;
    fsdp_options.mmap_threshold_bytes = a.fsdp_mmap_threshold;
    fsdp = std::make_unique<cohort::torch::FullyShardedDataParallel>(model, comm, fsdp_options, units);
    model->around_layer = [&fsdp](nn::Module& layer, const std::function<torch::Tensor()>& run_layer) {
      return fsdp->unit_forward(layer, run_layer);
    };
  } else {
    ddp = std::make_unique<cohort::torch::DistributedDataParallel>(model, comm, ddp_options);
  }
  auto forward = [&](const torch::Tensor& ids, const torch::Tensor& masked) {
    auto run_model = [&] { return model->forward(ids, masked); };
    return fsdp ? fsdp->forward_with(run_model) : ddp->forward_with(run_model);
  };
  // The optimizer steps the shards under --fsdp.
  const std::vector<torch::Tensor> params = fsdp ? fsdp->parameters() : ddp->parameters();

  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<cohort::torch::ShardedOptimizer> sharded;
  const cohort::torch::ShardedOptions stage{a.zero};
  if (a.optimizer == "sgd") {
    auto o = torch::optim::SGDOptions(a.lr).momentum(0.9).weight_decay(a.weight_decay);
    if (a.zero) sharded = std::make_unique<cohort::torch::ShardedOptimizer>(*ddp, o, stage);
    else optimizer = std::make_unique<torch::optim::SGD>(params, o);
  } else if (a.optimizer == "adam") {
    auto o = torch::optim::AdamOptions(a.lr).weight_decay(a.weight_decay);
    if (a.zero) sharded = std::make_unique<cohort::torch::ShardedOptimizer>(*ddp, o, stage);
    else optimizer = std::make_unique<torch::optim::Adam>(params, o);
  } else {
    auto o = torch::optim::AdamWOptions(a.lr).weight_decay(a.weight_decay);
    if (a.zero) sharded = std::make_unique<cohort::torch::ShardedOptimizer>(*ddp, o, stage);
    else optimizer = std::make_unique<torch::optim::AdamW>(params, o);
  }

  cohort::torch::DistributedSampler sampler(corpus.train.size(), world, rank, /*shuffle=*/true, a.seed);
  cohort::train::TrainingPosition pos{0, 0, 0, world, 0, world};
  const int restart = cohort::torch::restart_count();
  if (a.resume || (restart > 0 && !a.checkpoint_dir.empty())) {
    // FSDP's and the sharded optimizer's loads are collective: each rank reads what overlaps its shard.
    std::optional<cohort::train::TrainingPosition> loaded =
        fsdp      ? fsdp->load(a.checkpoint_dir, *optimizer)
        : sharded ? sharded->load(a.checkpoint_dir)
                  : cohort::torch::load_checkpoint(a.checkpoint_dir, *model, *optimizer);
    if (!loaded && a.resume) throw ConfigError(fmt::format("--resume: no checkpoint in {}", a.checkpoint_dir));
    if (loaded) {
      pos = *loaded;
      if (lead)
        fmt::print("resuming from {} at epoch {}, step {} (written by {} ranks, {} now)\n", a.checkpoint_dir, pos.epoch,
                   pos.step_in_epoch, pos.world_size, world);
    }
  }
  auto save = [&](const cohort::train::TrainingPosition& p) {
    if (a.checkpoint_dir.empty()) return;
    if (fsdp) fsdp->save(a.checkpoint_dir, *optimizer, p);  // collective: every rank writes its shard
    else if (sharded) sharded->save(a.checkpoint_dir, p);   // the same
    else if (lead) cohort::torch::save_checkpoint(a.checkpoint_dir, *model, *optimizer, p);
  };

  int64_t nparams = 0;
  for (auto& p : model->parameters()) nparams += p.numel();
  // The model's weights in Module::parameters() order. Under --fsdp they exist only gathered:
  // full_state_dict() is collective (every rank calls this) and lists the parameters first.
  auto digest = [&] {
    if (!fsdp) return weights_digest(model->parameters());
    std::vector<torch::Tensor> gathered;
    for (auto& [name, t] : fsdp->full_state_dict())
      if (gathered.size() < model->parameters().size()) gathered.push_back(t);
    return weights_digest(gathered);
  };
  // The same seed gives the twin (bench/bert_twin.py) the same weights: the twin prints this line too.
  // Resumed, the weights as loaded: equal to the saving run's final digest, at any world size.
  if (a.print_digest) {
    const uint64_t d = digest();
    if (lead) fmt::print("{} weights digest: {:016x}\n", pos.global_step == 0 ? "initial" : "resumed", d);
  }
  // --test-samples N evaluates the first N held-out glosses: the banner counts those, not the corpus's.
  const int64_t held_out = a.test_samples > 0 ? std::min<int64_t>(a.test_samples, static_cast<int64_t>(corpus.test.size()))
                                              : static_cast<int64_t>(corpus.test.size());
  if (lead)
    fmt::print("bert: {} layers, hidden {}, {} heads, sequence {}, vocabulary {}: {} parameters; {} training and {} "
               "held-out glosses; world {}, batch {} per rank, {}{}\n",
               s.layers, s.hidden, s.heads, s.seq_len, vocab, nparams, corpus.train.size(), held_out, world,
               a.batch, a.optimizer,
               a.zero ? fmt::format(" sharded (ZeRO stage {})", a.zero) : a.fsdp ? " fully sharded (FSDP)" : "");
  std::fflush(stdout);

  // --trace-phases N: time per phase of every step after the first N (examples/common/phase_times.h).
  std::optional<cohort::examples::PhaseTimes> phases;
  if (a.trace_phases > 0) phases.emplace(std::vector<std::string>{"zero_grad", "forward", "backward", "optimizer"}, a.trace_phases);
  // The communication wait the wrapper counted since the last phase ended (DDP's and the sharded
  // optimizer's gradient waits; FSDP's are inside its own phases and not counted here).
  double waited = 0;
  auto wait_since = [&] {
    const double now = ddp ? ddp->stats().wait_seconds : 0.0;
    const double d = now - waited;
    waited = now;
    return d;
  };

  comm->barrier();
  const auto t0 = std::chrono::steady_clock::now();
  int64_t samples = 0, steps_run = 0;
  bool stop = false;
  for (int64_t epoch = pos.epoch; epoch < a.epochs && !stop; ++epoch) {
    sampler.set_epoch(epoch);
    const bool resumed = epoch == pos.epoch && pos.epoch_cursor > 0;
    const int epoch_world = resumed ? pos.epoch_world : world;
    const int64_t cursor0 = resumed ? pos.epoch_cursor : 0, steps_before = resumed ? pos.step_in_epoch : 0;
    const auto indices = resumed ? sampler.indices_from(cursor0, epoch_world) : sampler.indices();
    const int64_t share = resumed ? sampler.longest_share(cursor0, epoch_world) : sampler.num_samples();
    const int64_t steps = (share + a.batch - 1) / a.batch, epoch_positions = sampler.total_size_for(epoch_world);
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t begin = std::min<int64_t>(step * a.batch, static_cast<int64_t>(indices.size()));
      const int64_t len = std::min<int64_t>(a.batch, static_cast<int64_t>(indices.size()) - begin);
      auto b = make_batch(corpus.train, indices, begin, len, s.seq_len, vocab, a.seed, static_cast<uint64_t>(epoch));
      auto ids = b.ids.to(device), masked = b.masked.to(device), labels = b.labels.to(device);
      const bool trace = steps_run < a.trace_memory;
      auto phase = [&](const char* what) {
        if (trace) fmt::print("rank {} step {} {}: {}\n", rank, steps_run, what, memory_now());
      };
      phase("start");
      if (phases) phases->begin_step(), wait_since();
      if (sharded) sharded->zero_grad();
      else if (fsdp) optimizer->zero_grad();
      else ddp->zero_grad();  // as torch 2.x's zero_grad(): released, or zeroed in place where a bucket view
      phase("after zero_grad");
      if (phases) phases->end_phase(0, wait_since());
      auto logits = forward(ids, masked);
      // An empty batch still takes part in the step (every rank's gradients are averaged): zero loss.
      auto loss = len > 0 ? torch::nn::functional::cross_entropy(logits, labels) : logits.sum() * 0.0;
      phase("after forward");
      if (phases) phases->end_phase(1, wait_since());
      loss.backward();
      phase("after backward");
      if (phases) phases->end_phase(2, wait_since());
      if (sharded) sharded->step();
      else optimizer->step();
      phase("after step");
      if (phases) phases->end_phase(3, wait_since()), phases->end_step(rank);
      samples += len;
      ++steps_run;
      ++pos.global_step;
      const int64_t shown = steps_before + step;
      if (lead && shown % 10 == 0) {
        fmt::print("epoch: {}, step: {}/{}, loss: {:.4f}\n", epoch, shown, steps_before + steps, loss.item<float>());
        std::fflush(stdout);
      }
      const int64_t cursor = std::min(cursor0 + (step + 1) * a.batch * world, epoch_positions);
      cohort::train::TrainingPosition next{epoch, shown + 1, pos.global_step, world, cursor, epoch_world};
      if (step + 1 == steps) next = {epoch + 1, 0, pos.global_step, world, 0, world};
      if (a.checkpoint_every > 0 && pos.global_step % a.checkpoint_every == 0) save(next);
      if (a.kill_after_steps > 0 && steps_run == a.kill_after_steps) {
        std::fflush(stdout);
        std::raise(SIGKILL);  // fault injection for the resume test: no cleanup, no final checkpoint
      }
      if (a.max_steps > 0 && steps_run == a.max_steps) {
        stop = true;
        pos = next;
        break;
      }
    }
    if (!stop) pos = {epoch + 1, 0, pos.global_step, world, 0, world};
  }
  examples::wait_for_device(device);  // the GPU's queued steps are part of the run: without this the figure flatters
  comm->barrier();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  save(pos);

  // Masked-token accuracy and loss on the held-out glosses: each rank its share, summed. The loss (mean
  // cross-entropy per masked token) tells runs apart long before the accuracy leaves the share of the most
  // common token, which is where every run of a few hundred steps sits.
  int64_t counts[2] = {0, 0};  // correct, predicted
  double loss_sum = 0;
  {
    torch::NoGradGuard no_grad;
    model->eval();
    std::vector<int64_t> mine;
    for (int64_t i = rank; i < held_out; i += world) mine.push_back(i);
    for (int64_t i = 0; i < static_cast<int64_t>(mine.size()); i += 256) {
      const int64_t n = std::min<int64_t>(256, static_cast<int64_t>(mine.size()) - i);
      auto b = make_batch(corpus.test, mine, i, n, s.seq_len, vocab, a.seed, ~uint64_t{0});
      // Under --fsdp through the wrapper: the units are gathered only there.
      auto logits = (fsdp ? forward(b.ids.to(device), b.masked.to(device)) : model->forward(b.ids.to(device), b.masked.to(device)))
                        .to(torch::kCPU);
      counts[0] += logits.argmax(1).eq(b.labels).sum().item<int64_t>();
      // Per token in the logits' precision, summed in double: a double copy of the logits (tokens x
      // vocabulary) would double the evaluation's largest tensor.
      loss_sum += torch::nn::functional::cross_entropy(
                      logits, b.labels, torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone))
                      .sum(torch::kFloat64)
                      .item<double>();
      counts[1] += b.labels.numel();
    }
    model->train();
  }
  comm->allreduce(counts, counts, 2, cohort::DataType::kInt64, cohort::ReduceOp::kSum);
  comm->allreduce(&loss_sum, &loss_sum, 1, cohort::DataType::kFloat64, cohort::ReduceOp::kSum);
  int64_t total_samples = samples;
  comm->allreduce(&total_samples, &total_samples, 1, cohort::DataType::kInt64, cohort::ReduceOp::kSum);
  double wait = ddp ? ddp->stats().wait_seconds : 0.0;
  comm->allreduce(&wait, &wait, 1, cohort::DataType::kFloat64, cohort::ReduceOp::kAvg);
  // Memory per rank: what the optimizer keeps, and the process's peak.
  const size_t state = sharded ? sharded->state_bytes() : state_bytes(*optimizer, a.optimizer);
  double memory[3] = {static_cast<double>(state) / 1e6, peak_rss_mb(), 0};
  std::vector<double> all(3 * static_cast<size_t>(world));
  comm->allgather(memory, all.data(), 3, cohort::DataType::kFloat64);
  const uint64_t final_digest = a.print_digest ? digest() : 0;  // collective under --fsdp
  if (lead) {
    fmt::print("masked-token accuracy (held-out): {:.4f} ({} of {})\n",
               counts[1] ? static_cast<double>(counts[0]) / static_cast<double>(counts[1]) : 0.0, counts[0], counts[1]);
    fmt::print("masked-token loss (held-out): {:.4f}\n", counts[1] ? loss_sum / static_cast<double>(counts[1]) : 0.0);
    fmt::print("samples/s: {:.1f} ({} samples on {} ranks in {:.3f} s, {} steps per rank)\n",
               seconds > 0 ? static_cast<double>(total_samples) / seconds : 0.0, total_samples, world, seconds, steps_run);
    fmt::print("communication wait: {:.1f}% of step time ({:.3f} s per rank, averaged over ranks)\n",
               seconds > 0 ? 100.0 * wait / seconds : 0.0, wait);
    for (int r = 0; r < world; ++r)
      fmt::print("rank {}: optimizer state {:.1f} MB, peak RSS {:.1f} MB\n", r, all[3 * size_t(r)], all[3 * size_t(r) + 1]);
    if (a.print_digest) fmt::print("final weights digest: {:016x}\n", final_digest);
  }
  if (phases) fmt::print("{}\n", phases->summary(rank));  // every rank its own line
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"BERT-style masked-LM pretraining on WordNet's glosses with libtorch and cohort (run under `cohort run`)",
               "bert"};
  Args a;
  app.add_option("--size", a.size, "mini (2 x 128, an epoch in minutes on 2 CPU cores), small (4 x 256) or base (12 x 768)")
      ->check(CLI::IsMember({"mini", "small", "base"}));
  app.add_option("--layers", a.layers, "encoder layers (overrides --size)")->check(kNotNegative);
  app.add_option("--hidden", a.hidden, "hidden width (overrides --size)")->check(kNotNegative);
  app.add_option("--heads", a.heads, "attention heads (overrides --size)")->check(kNotNegative);
  app.add_option("--seq-len", a.seq_len, "tokens per sequence, [CLS] and [SEP] included (overrides --size)")->check(kNotNegative);
  app.add_option("--vocab", a.vocab, "vocabulary size, the 5 special tokens included (overrides --size)")->check(kNotNegative);
  app.add_option("--batch", a.batch, "sequences per rank and step")->check(kAtLeastOne);
  app.add_option("--lr", a.lr, "learning rate")->check(kPositive);
  app.add_option("--weight-decay", a.weight_decay, "weight decay")->check(kNotNegative);
  app.add_option("--dropout", a.dropout, "dropout probability")->check(kNotNegative);
  app.add_option("--optimizer", a.optimizer, "adamw, adam or sgd (momentum 0.9)")->check(CLI::IsMember({"adamw", "adam", "sgd"}));
  app.add_option("--zero", a.zero, "0: every rank keeps the whole optimizer state; 1: sharded (ZeRO stage 1); 2: the gradients too")
      ->check(CLI::IsMember({0, 1, 2}));
  app.add_flag("--fsdp", a.fsdp,
               "fully sharded data parallel (cohort::torch::FullyShardedDataParallel): each rank keeps 1/N of the "
               "parameters, gradients and optimizer state; every encoder layer is a unit");
  app.add_option("--epochs", a.epochs, "epochs")->check(kAtLeastOne);
  app.add_option("--max-steps", a.max_steps, "stop after N steps of this run (0: the epochs)")->check(kNotNegative);
  app.add_option("--train-samples", a.train_samples, "use only the first N training glosses (0: all)")->check(kNotNegative);
  app.add_option("--test-samples", a.test_samples, "evaluate on the first N held-out glosses only (0: all 5,882)")
      ->check(kNotNegative);
  app.add_option("--data-dir", a.data_dir, "WordNet's database folder (data.noun, data.verb, data.adj, data.adv)");
  app.add_option("--seed", a.seed, "seed of the model's initialisation, the sampler and the masking");
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "checkpoints go here; a restarted job resumes from the newest");
  app.add_option("--checkpoint-every", a.checkpoint_every, "checkpoint every N steps (and at the end)")->check(kNotNegative);
  app.add_flag("--resume", a.resume, "continue from the newest complete checkpoint in --checkpoint-dir (restarts do so anyway)");
  app.add_option("--compression", a.compression, "gradients on the wire: none, fp16 or bf16");
  app.add_option("--bucket-mb", a.bucket_mb, "gradient bucket size in MiB")->check(kPositive);
  app.add_option("--device", a.device, "cpu, or cuda: the model on this rank's GPU, gradients reduced by NCCL");
  app.add_option("--threads", a.threads, "intra-op threads per rank (0: 1 when ranks share a host)")->check(kNotNegative);
  app.add_flag("--verbose", a.verbose, "print more of the setup");
  app.add_option("--kill-after-steps", a.kill_after_steps, "testing: SIGKILL every rank after N steps of this run");
  app.add_flag("--print-digest", a.print_digest, "print a digest of the final weights (resume tests)");
  app.add_option("--fsdp-mmap-threshold", a.fsdp_mmap_threshold,
                 "--fsdp: glibc's mmap threshold in bytes, fixed at construction (FSDPOptions::mmap_threshold_bytes); 0 "
                 "leaves glibc's own, which rises to the largest block freed (bench/fsdp_memory.sh's fsdp-glibc)");
  app.add_option("--trace-memory", a.trace_memory, "print every rank's resident memory after each phase of the first N steps")
      ->check(kNotNegative);
  app.add_option("--trace-phases", a.trace_phases,
                 "print every rank's wall and CPU time per phase (zero_grad, forward, backward, the optimizer), page faults, "
                 "switches and two probes of its core, for each step after the first N and averaged at the end "
                 "(0: off)")
      ->check(kNotNegative);
  return cohort::examples::parse_and_run("bert", app, argc, argv, [&] { return run(a); });
}
