// cohort::Store on top of torch's c10d::Store (TCPStore under env:// and torchrun, PrefixStore
// around it for each group, FileStore/HashStore when the user passes one): what cohort's
// communicator rendezvous through when torch made the store. Only torch's Store header: this file
// compiles without the rest of torch.
#pragma once

#include <memory>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "cohort/store.h"

namespace cohort_torch {

// The adapter around `store`; torch's exceptions leave it as cohort's (TimeoutError, PeerLostError).
std::shared_ptr<cohort::Store> make_store_adapter(c10::intrusive_ptr<c10d::Store> store);

}  // namespace cohort_torch
