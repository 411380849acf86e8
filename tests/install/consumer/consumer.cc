// A libtorch program of a user's own, trained data-parallel with cohort's DDP and built against an
// installed cohort (find_package(cohort COMPONENTS torch), headers from <prefix>/include).
// Each rank draws its own batches of y = sum(x); the model must learn it, and the replicas must stay
// identical: every rank prints the first and last loss and its parameters' checksum, and the
// checksum's allreduced minimum and maximum, which are equal when the replicas are.
#include <cohort/cohort.h>
#include <cohort/torch/ddp.h>
#include <torch/torch.h>

#include <cstdio>

int main() {
  auto comm = cohort::Communicator::from_env();
  torch::manual_seed(0);  // the same initial weights everywhere (DDP broadcasts rank 0's anyway)
  auto net = torch::nn::Sequential(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
  cohort::torch::DistributedDataParallel model(net, comm);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.02));
  torch::manual_seed(100 + comm->rank());  // each rank its own data
  float first = 0, last = 0;
  for (int step = 0; step < 200; ++step) {
    auto x = torch::randn({32, 8});
    auto y = x.sum(1, true);
    optimizer.zero_grad();
    auto loss = torch::mse_loss(model->forward(x), y);
    loss.backward();
    optimizer.step();
    (step == 0 ? first : last) = loss.item<float>();
  }
  double checksum = 0;
  for (const auto& p : model.parameters()) checksum += p.to(torch::kDouble).abs().sum().item<double>();
  double low = 0, high = 0;
  comm->allreduce(&checksum, &low, 1, cohort::DataType::kFloat64, cohort::ReduceOp::kMin);
  comm->allreduce(&checksum, &high, 1, cohort::DataType::kFloat64, cohort::ReduceOp::kMax);
  std::printf("rank %d of %d: loss %.4f -> %.4f; checksum %.9f, min %.9f, max %.9f (%s)\n", comm->rank(),
              comm->size(), first, last, checksum, low, high, low == high ? "replicas identical" : "REPLICAS DIFFER");
  return low == high && last < first / 4 ? 0 : 1;
}
