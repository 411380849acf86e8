// ps_ctr: a sparse wide model trained on cohort's parameter servers (issue 18).
//
//   cohort run --ps 1 --nproc-per-node 2 build/examples/ps_ctr/ps_ctr
//   cohort run --ps 2 --ps-mode bsp --nproc-per-node 2 build/examples/ps_ctr/ps_ctr --epochs 1
//   build/examples/ps_ctr/ps_ctr            (no launcher: one worker, a server on a thread)
//
// The model is what a click-through-rate model looks like, on data everyone has: softmax regression
// over 10 classes on hashed sparse features of Fashion-MNIST. Every pixel whose intensity falls in
// bucket b > 0 (of --buckets) is the feature hash(pixel, b) mod 2^--hash-bits; an image has a few
// hundred of them. The weights are one sparse table "emb" of dim 10 (one weight per class) on the
// servers, keyed by feature id, plus one more row, the bias, that every image has (its id is
// 2^--hash-bits, outside the hash range). No worker ever holds the table: per step it
//   1. collects the unique feature ids of its mini-batch,
//   2. pulls their rows, sums each image's rows into its logits, computes softmax cross-entropy,
//   3. pushes the rows' gradients (the servers apply Adagrad) and ends the step.
// Pushing step s and pulling for step s+1 is one push_pull (one round trip per server); --separate
// makes them pull, push and step() calls. The consistency mode (async, bsp, stale:K) is the job's
// (`cohort run --ps-mode`); the program is the same under all three.
//
// Each worker trains on its shard of the training set (image i goes to worker i mod num_workers,
// every shard cut to the same length so that every worker runs the same number of steps, which bsp
// and stale modes need). At the end the workers meet through an ordinary cohort::Communicator (the
// launcher gives the workers RANK/WORLD_SIZE = worker index/count): each evaluates its share of the
// 10k test images and an allreduce sums the counts.
//
// The default run (2 epochs, batch 128, Adagrad lr 0.02, 8 buckets; 2 workers, 1 server) reaches a
// test accuracy of 0.83 (0.830-0.833 measured under async, bsp and stale:2, 1 or 2 servers) in about
// 4 s of training on a 2-core machine; bsp results are the same whatever the server count.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cohort/communicator.h"
#include "common/launch.h"
#include "cohort/error.h"
#include "cohort/ps.h"
#include "store/memory_store.h"
#include "dataset/fashion_mnist_files.h"

namespace ps = cohort::ps;
using cohort::ConfigError;

namespace {

constexpr int kClasses = 10;
constexpr int kPixels = 28 * 28;

// ---- data: examples/dataset/fashion_mnist_files.h ----
struct Split {
  std::string pixels;  // n * 784 intensities
  std::string labels;  // n labels 0..9
  size_t size() const { return labels.size(); }
  const uint8_t* image(size_t i) const { return reinterpret_cast<const uint8_t*>(pixels.data()) + i * kPixels; }
  int label(size_t i) const { return uint8_t(labels[i]); }
};

Split load_split(const std::string& dir, const std::string& prefix) {
  auto split = cohort::examples::read_fashion_mnist(dir, prefix);
  return {std::move(split.pixels), std::move(split.labels)};
}

// ---- features ----
uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// A feature is a key k = pixel * buckets + bucket (bucket 1..buckets-1), plus the bias key
// 784 * buckets. Its id in the table is hash(pixel, bucket) mod 2^hash_bits (the bias: 2^hash_bits).
// The ids are a fixed function of the key, so they are computed once.
class Features {
 public:
  Features(int buckets, int hash_bits, bool cumulative) : buckets_(buckets), cumulative_(cumulative) {
    const uint64_t mask = (uint64_t(1) << hash_bits) - 1;
    ids_.resize(static_cast<size_t>(kPixels * buckets) + 1);
    for (int p = 0; p < kPixels; ++p)
      for (int b = 0; b < buckets; ++b)
        ids_[static_cast<size_t>(p * buckets + b)] = mix64((uint64_t(p) << 8) | uint64_t(b)) & mask;
    ids_.back() = mask + 1;
  }
  size_t num_keys() const { return ids_.size(); }
  uint64_t id(uint32_t key) const { return ids_[key]; }

  // Appends the keys of one image: one per pixel in a bucket above 0 (--cumulative: the pixel's
  // buckets 1..b, a thermometer code), and the bias.
  void keys(const uint8_t* image, std::vector<uint32_t>& out) const {
    for (int p = 0; p < kPixels; ++p) {
      const int b = image[p] * buckets_ / 256;
      if (b == 0) continue;
      if (cumulative_) {
        for (int q = 1; q <= b; ++q) out.push_back(static_cast<uint32_t>(p * buckets_ + q));
      } else {
        out.push_back(static_cast<uint32_t>(p * buckets_ + b));
      }
    }
    out.push_back(static_cast<uint32_t>(ids_.size() - 1));
  }

 private:
  int buckets_;
  bool cumulative_;
  std::vector<uint64_t> ids_;
};

// A mini-batch in the form the model needs: for each image the local rows of its features (CSR),
// and the unique feature ids to pull, in the order of the local rows.
struct Batch {
  std::vector<uint32_t> offsets;  // image j's local rows are rows[offsets[j] .. offsets[j+1])
  std::vector<uint32_t> rows;
  std::vector<uint64_t> ids;      // local row r is the table row of ids[r]
  std::vector<int> labels;
  size_t size() const { return labels.size(); }
};

class BatchBuilder {
 public:
  explicit BatchBuilder(const Features& features)
      : features_(features), slot_(features.num_keys()), stamp_(features.num_keys(), 0) {}

  void build(const Split& data, const uint32_t* indices, size_t n, Batch& out) {
    if (++now_ == 0) {  // the stamps wrapped: forget them all
      std::fill(stamp_.begin(), stamp_.end(), 0);
      now_ = 1;
    }
    out.offsets.assign(1, 0);
    out.rows.clear();
    out.ids.clear();
    out.labels.clear();
    for (size_t j = 0; j < n; ++j) {
      keys_.clear();
      features_.keys(data.image(indices[j]), keys_);
      for (uint32_t k : keys_) {
        if (stamp_[k] != now_) {
          stamp_[k] = now_;
          slot_[k] = static_cast<uint32_t>(out.ids.size());
          out.ids.push_back(features_.id(k));
        }
        out.rows.push_back(slot_[k]);
      }
      out.offsets.push_back(static_cast<uint32_t>(out.rows.size()));
      out.labels.push_back(data.label(indices[j]));
    }
  }

 private:
  const Features& features_;
  std::vector<uint32_t> slot_, stamp_, keys_;
  uint32_t now_ = 0;
};

// Logits of image j: the sum of its rows (the bias among them).
void logits(const Batch& b, size_t j, const float* weights, float* z) {
  std::fill(z, z + kClasses, 0.0f);
  for (uint32_t r = b.offsets[j]; r < b.offsets[j + 1]; ++r) {
    const float* w = weights + size_t(b.rows[r]) * kClasses;
    for (int c = 0; c < kClasses; ++c) z[c] += w[c];
  }
}

// Mean softmax cross-entropy of the batch; grads (ids.size() * 10 floats) get its gradient.
double forward_backward(const Batch& b, const float* weights, std::vector<float>& grads) {
  grads.assign(b.ids.size() * kClasses, 0.0f);
  const float scale = 1.0f / static_cast<float>(b.size());
  double loss = 0;
  float z[kClasses];
  for (size_t j = 0; j < b.size(); ++j) {
    logits(b, j, weights, z);
    const float top = *std::max_element(z, z + kClasses);
    float sum = 0;
    for (float& v : z) sum += (v = std::exp(v - top));
    const int y = b.labels[j];
    loss += -std::log(std::max(z[y] / sum, 1e-30f));
    for (int c = 0; c < kClasses; ++c) z[c] = (z[c] / sum - (c == y ? 1.0f : 0.0f)) * scale;
    for (uint32_t r = b.offsets[j]; r < b.offsets[j + 1]; ++r) {
      float* g = grads.data() + size_t(b.rows[r]) * kClasses;
      for (int c = 0; c < kClasses; ++c) g[c] += z[c];
    }
  }
  return loss / static_cast<double>(b.size());
}

int64_t count_correct(const Batch& b, const float* weights) {
  int64_t correct = 0;
  float z[kClasses];
  for (size_t j = 0; j < b.size(); ++j) {
    logits(b, j, weights, z);
    correct += (std::max_element(z, z + kClasses) - z) == b.labels[j];
  }
  return correct;
}

// ---- the job ----
struct Args {
  int epochs = 2;
  int batch = 128;
  float lr = 0.02f;
  int buckets = 8;
  int hash_bits = 22;
  bool cumulative = false;
  std::string optimizer = "adagrad";
  std::string storage = "float32";
  std::string data_dir = cohort::examples::kFashionMnistDir;
  uint64_t seed = 0;
  size_t train_samples = 0;
  int log_every = 10;
  bool separate = false;
  std::string save_dir, load_dir;
};

const char* env(const char* name) {
  const char* v = std::getenv(name);
  return v && *v ? v : nullptr;
}

bool launched() {
  for (const char* v : {"COHORT_ROLE", "COHORT_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"})
    if (env(v)) return true;
  return false;
}

int env_rank() {
  for (const char* v : {"RANK", "COHORT_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"})
    if (const char* s = env(v)) return std::atoi(s);
  return 0;
}

ps::Optimizer parse_optimizer(const std::string& s) {
  if (s == "sgd") return ps::Optimizer::kSgd;
  if (s == "adagrad") return ps::Optimizer::kAdagrad;
  return ps::Optimizer::kAdam;
}

cohort::DataType parse_storage(const std::string& s) {
  if (s == "float16") return cohort::DataType::kFloat16;
  if (s == "bfloat16") return cohort::DataType::kBFloat16;
  return cohort::DataType::kFloat32;
}

const char* plural(int n) { return n == 1 ? "" : "s"; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int train(const Args& a, ps::Client& client, cohort::Communicator& comm) {
  const int worker = client.worker_index(), workers = client.num_workers();
  const bool lead = worker == 0;
  if (comm.size() != workers || comm.rank() != worker)
    throw ConfigError(fmt::format("the workers' communicator has rank {} of {}, but the parameter-server client says "
                                  "worker {} of {} (the launcher should give workers RANK/WORLD_SIZE = worker index/count)",
                                  comm.rank(), comm.size(), worker, workers));

  // Data first: a missing data set fails before anything is declared.
  Split train_set = load_split(a.data_dir, "train");
  Split test_set = load_split(a.data_dir, "t10k");
  const size_t train_size = a.train_samples > 0 ? std::min(a.train_samples, train_set.size()) : train_set.size();

  ps::TableConfig config;
  config.dim = kClasses;
  config.optimizer = parse_optimizer(a.optimizer);
  config.lr = a.lr;
  config.storage = parse_storage(a.storage);
  client.create_table("emb", config);  // every worker declares it; the declarations must agree

  if (!a.load_dir.empty()) {
    if (lead) {
      client.load(a.load_dir);
      fmt::print("loaded the tables from {}\n", a.load_dir);
    }
    comm.barrier();  // nobody trains on the table before it is loaded
  }

  // This worker's shard: images worker, worker + workers, ... cut to the same length on every worker.
  const size_t shard_size = train_size / static_cast<size_t>(workers);
  std::vector<uint32_t> shard(shard_size);
  for (size_t i = 0; i < shard_size; ++i) shard[i] = static_cast<uint32_t>(i * workers + worker);
  const size_t batch = static_cast<size_t>(a.batch);
  const int64_t steps_per_epoch = static_cast<int64_t>((shard_size + batch - 1) / batch);
  const int64_t total_steps = steps_per_epoch * a.epochs;
  if (lead)
    fmt::print("ps_ctr: {} worker{}, {} server{}, mode {}; table emb: dim {}, {} buckets, 2^{} hashed ids, {} "
               "lr {}; {} images per worker, batch {}, {} steps per epoch\n",
               workers, plural(workers), client.num_servers(), plural(client.num_servers()), client.mode().to_string(),
               kClasses, a.buckets, a.hash_bits, a.optimizer, a.lr, shard_size, batch, steps_per_epoch);

  Features features(a.buckets, a.hash_bits, a.cumulative);
  BatchBuilder builder(features);
  std::vector<uint32_t> order;
  // The batch of global step s (the shard reshuffled every epoch, differently on every worker).
  auto make_batch = [&](int64_t s, Batch& out) {
    const int64_t epoch = s / steps_per_epoch, step = s % steps_per_epoch;
    if (step == 0) {
      order = shard;
      std::mt19937_64 rng(mix64(a.seed * 1000003u + static_cast<uint64_t>(epoch) * 1009u + static_cast<uint64_t>(worker)));
      std::shuffle(order.begin(), order.end(), rng);
    }
    const size_t begin = static_cast<size_t>(step) * batch;
    builder.build(train_set, order.data() + begin, std::min(batch, shard_size - begin), out);
  };

  comm.barrier();  // start the clock together
  const auto t0 = std::chrono::steady_clock::now();
  double ps_seconds = 0;  // time inside the client's calls
  auto timed = [&](auto&& call) {
    const auto c0 = std::chrono::steady_clock::now();
    call();
    ps_seconds += seconds_since(c0);
  };

  Batch cur, next;
  std::vector<float> weights, next_weights, grads;
  double loss_sum = 0;
  uint64_t rows_moved = 0;
  if (total_steps > 0) {
    make_batch(0, cur);
    weights.resize(cur.ids.size() * kClasses);
    timed([&] { client.pull("emb", cur.ids.data(), cur.ids.size(), weights.data()); });
  }
  for (int64_t s = 0; s < total_steps; ++s) {
    const double loss = forward_backward(cur, weights.data(), grads);
    loss_sum += loss;
    rows_moved += 2 * cur.ids.size();
    if (lead && (s % a.log_every == 0 || s + 1 == total_steps)) {
      fmt::print("step {} (epoch {}, {}/{}): loss {:.4f}\n", s, s / steps_per_epoch, s % steps_per_epoch + 1,
                 steps_per_epoch, loss);
      std::fflush(stdout);
    }
    if (s + 1 == total_steps) {  // the last step: nothing more to pull
      timed([&] {
        client.push("emb", cur.ids.data(), cur.ids.size(), grads.data());
        client.step();
      });
      break;
    }
    make_batch(s + 1, next);
    next_weights.resize(next.ids.size() * kClasses);
    if (a.separate) {
      timed([&] {
        client.push("emb", cur.ids.data(), cur.ids.size(), grads.data());
        client.step();
        client.pull("emb", next.ids.data(), next.ids.size(), next_weights.data());
      });
    } else {
      timed([&] {
        client.push_pull("emb", cur.ids.data(), cur.ids.size(), grads.data(), next.ids.data(), next.ids.size(),
                         next_weights.data());
      });
    }
    std::swap(cur, next);
    std::swap(weights, next_weights);
  }
  const double train_seconds = seconds_since(t0);
  comm.barrier();  // every push is in (async mode applies them on arrival) before anyone evaluates
  const double all_seconds = seconds_since(t0);

  // Evaluation: test images worker, worker + workers, ...; one pull of every feature they use.
  std::vector<uint32_t> share;
  for (size_t i = static_cast<size_t>(worker); i < test_set.size(); i += static_cast<size_t>(workers))
    share.push_back(static_cast<uint32_t>(i));
  Batch test;
  builder.build(test_set, share.data(), share.size(), test);
  weights.resize(test.ids.size() * kClasses);
  client.pull("emb", test.ids.data(), test.ids.size(), weights.data());
  // Saved after that pull: in bsp mode it is the pull that waits until the last step is applied
  // (step() does not wait), so the save holds it too.
  if (!a.save_dir.empty() && lead) {
    client.save(a.save_dir);
    fmt::print("saved the tables to {}\n", a.save_dir);
  }
  int64_t counts[4] = {count_correct(test, weights.data()), static_cast<int64_t>(test.size()),
                       static_cast<int64_t>(shard_size) * a.epochs,
                       static_cast<int64_t>(rows_moved)};
  comm.allreduce(counts, counts, 4, cohort::DataType::kInt64, cohort::ReduceOp::kSum);
  double times[3] = {ps_seconds, loss_sum / static_cast<double>(std::max<int64_t>(total_steps, 1)), train_seconds};
  comm.allreduce(times, times, 3, cohort::DataType::kFloat64, cohort::ReduceOp::kAvg);
  const ps::TableStats stats = client.stats("emb");

  if (lead) {
    fmt::print("test accuracy: {:.4f} ({} of {} test images, evaluated by {} worker{})\n",
               static_cast<double>(counts[0]) / static_cast<double>(std::max<int64_t>(counts[1], 1)), counts[0], counts[1],
               workers, plural(workers));
    if (total_steps > 0) {
      fmt::print("training: {} samples in {:.2f} s ({:.0f} samples/s over {} worker{}, {} steps per worker, mean loss {:.4f})\n",
                 counts[2], all_seconds, static_cast<double>(counts[2]) / all_seconds, workers, plural(workers), total_steps,
                 times[1]);
      fmt::print("parameter server: {:.1f}% of a worker's step time in pull/push ({:.2f} s of {:.2f} s, averaged over "
                 "workers), {:.0f} rows pulled + pushed per worker step\n",
                 100.0 * times[0] / times[2], times[0], times[2],
                 static_cast<double>(counts[3]) / static_cast<double>(workers * total_steps));
    }
    fmt::print("table emb: {} rows, {:.2f} MiB on {} server{}, applied_rows {} ({} by workers in the server's shared "
               "memory)\n",
               stats.rows, static_cast<double>(stats.bytes) / (1 << 20), client.num_servers(),
               plural(client.num_servers()), stats.applied_rows, stats.direct_applied_rows);
  }
  return 0;
}

int run(const Args& a) {
  const char* role = env("COHORT_ROLE");
  if (role && std::string(role) == "server") {  // `cohort run --ps N --ps-server program`
    ps::serve_from_env();
    return 0;
  }
  if (role && std::string(role) == "worker") {
    auto client = ps::Client::from_env();
    auto comm = cohort::Communicator::from_env();
    return train(a, *client, *comm);
  }
  if (role) throw ConfigError(fmt::format("COHORT_ROLE is '{}'; expected worker or server", role));
  if (launched())
    throw ConfigError("this is a parameter-server program: run it with `cohort run --ps N ...` (no COHORT_ROLE is set)");

  // No launcher: one worker here, and one server on a thread of this process, meeting in memory.
  std::shared_ptr<cohort::Store> store = cohort::make_memory_store();
  ps::Roles roles;
  roles.num_servers = 1;
  roles.num_workers = 1;
  auto server_error = std::make_shared<std::exception_ptr>();
  std::thread server([store, roles, server_error] {
    try {
      ps::serve(store, 0, roles);
    } catch (...) {
      *server_error = std::current_exception();
    }
  });
  int rc = 0;
  try {
    auto client = ps::Client::create(store, 0, roles);
    auto comm = cohort::Communicator::create(cohort::make_memory_store(), 0, 1);
    rc = train(a, *client, *comm);
  } catch (...) {
    server.detach();  // it may still wait for a client that never came; the process exits around it
    throw;
  }
  server.join();  // the client is closed: the server returns
  if (*server_error) std::rethrow_exception(*server_error);
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Softmax regression on hashed Fashion-MNIST features, on cohort's parameter servers "
               "(cohort run --ps N --nproc-per-node M ps_ctr)",
               "ps_ctr"};
  Args a;
  const CLI::Validator& positive = cohort::examples::kPositive;
  const CLI::Validator& at_least_one = cohort::examples::kAtLeastOne;
  const CLI::Validator& not_negative = cohort::examples::kNotNegative;
  app.add_option("--epochs", a.epochs, "passes over each worker's shard (0: evaluate only, with --load-dir)")
      ->check(not_negative);
  app.add_option("--batch", a.batch, "images per mini-batch, per worker")->check(at_least_one);
  app.add_option("--lr", a.lr, "learning rate of the servers' optimizer")->check(positive);
  app.add_option("--buckets", a.buckets, "intensity buckets per pixel (bucket 0, the background, has no feature)")
      ->check(CLI::Range(2, 256));
  app.add_option("--hash-bits", a.hash_bits, "features are hashed to ids 0 .. 2^bits - 1")->check(CLI::Range(8, 62));
  app.add_flag("--cumulative", a.cumulative,
               "a pixel in bucket b has the features of buckets 1..b (a thermometer code) instead of bucket b's alone");
  app.add_option("--optimizer", a.optimizer, "the table's optimizer on the servers")
      ->check(CLI::IsMember({"sgd", "adagrad", "adam"}));
  app.add_option("--storage", a.storage, "the table's row storage on the servers")
      ->check(CLI::IsMember({"float32", "float16", "bfloat16"}));
  app.add_option("--data-dir", a.data_dir, "folder with the gzip idx files");
  app.add_option("--seed", a.seed, "seed of the shuffling");
  app.add_option("--train-samples", a.train_samples, "use only the first N training images (0 = all)");
  app.add_option("--log-every", a.log_every, "worker 0 prints the loss every N steps")->check(at_least_one);
  app.add_flag("--separate", a.separate, "pull, push and step() as separate calls instead of one push_pull per step");
  app.add_option("--save-dir", a.save_dir, "after training, worker 0 has the servers save the tables here");
  app.add_option("--load-dir", a.load_dir, "before training, worker 0 has the servers load the tables from here");
  // Only worker 0 reports bad arguments, so a launched job prints the problem once.
  const char* role = env("COHORT_ROLE");
  const bool report = role ? std::string(role) == "worker" && env_rank() == 0 : env_rank() == 0;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    if (report) std::fprintf(stderr, "ps_ctr: %s\n", e.what());
    return 2;
  }
  try {
    return run(a);
  } catch (const ConfigError& e) {
    if (report || (role && std::string(role) == "server")) std::fprintf(stderr, "ps_ctr: %s\n", e.what());
    return 2;
  } catch (const cohort::InvalidArgument& e) {
    std::fprintf(stderr, "ps_ctr: %s %d: %s\n", role ? role : "rank", env_rank(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ps_ctr: %s %d: %s\n", role ? role : "rank", env_rank(), e.what());
    return 1;
  }
}
