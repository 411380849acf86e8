// cohort_ps: cohort's parameter-server client (and server) for Python, on numpy arrays.
//
//   import numpy as np, cohort_ps
//   ps = cohort_ps.Client.from_env()            # under `cohort run --ps N --nproc-per-node M python3 x.py`
//   ps.create_table("emb", dim=16, optimizer="adagrad", lr=0.05)
//   rows = ps.pull("emb", ids)                  # ids: integer array (n,) -> float32 array (n, 16)
//   ps.push("emb", ids, grads)                  # grads: (n, 16) or n * 16 floats
//   ps.step()
//   ps.close()                                  # or `with cohort_ps.Client.from_env() as ps:`
//
// No torch needed: a CPU tensor goes in as it is (numpy.asarray reads it through __array__), or as
// t.detach().numpy(); a pulled array becomes a tensor with torch.from_numpy(rows) (no copy).
//
// Design:
// - Every argument is converted on the calling thread with the GIL held: ids to a contiguous uint64
//   array (any integer dtype; negative ids and non-integer arrays are refused: a float id is almost
//   always a bug), grads to contiguous float32 (a float64 array is converted). Then the GIL is
//   released for the blocking call, so other Python threads (a data loader) run meanwhile. The
//   converted arrays are local py::objects that outlive the call.
// - Errors keep cohort's message and class: cohort_ps.Error (a RuntimeError) and its subclasses
//   InvalidArgument (also a ValueError), ConfigError, TimeoutError (also the builtin TimeoutError),
//   PeerLostError, MismatchError, AuthError, AbortedError.
// - The servers run until every worker has closed its client, so close() matters: a client is closed
//   by close(), by leaving a `with` block, when it is garbage collected, and at interpreter exit
//   (an atexit hook closes the clients still open).
// - A table's dim is asked from the client once (Client.table) and remembered.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include <fmt/format.h>

#include <string>

#include "cohort/error.h"
#include "cohort/ps.h"
#include "ps/config_json.h"
#include "cohort/types.h"

namespace py = pybind11;
namespace ps = cohort::ps;

namespace cohort_ps {

using IdArray = py::array_t<uint64_t, py::array::c_style>;
using FloatArray = py::array_t<float, py::array::c_style>;

// ---- argument conversion ----
py::array as_array(const py::handle& obj) {
  if (py::isinstance<py::array>(obj)) return py::reinterpret_borrow<py::array>(obj);
  return py::module_::import("numpy").attr("asarray")(obj);
}

// Any integer array (or list, or CPU tensor) -> contiguous uint64 array of its elements, flattened.
IdArray to_ids(const py::handle& obj, const char* what) {
  py::array a = as_array(obj);
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u' && !(a.size() == 0))
    throw py::type_error(std::string(what) + " must be an array of integers, got dtype " +
                         py::str(a.dtype()).cast<std::string>());
  if (kind == 'i' && a.size() > 0) {
    auto signed_ids = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(a);
    const int64_t* p = signed_ids.data();
    for (py::ssize_t i = 0; i < signed_ids.size(); ++i)
      if (p[i] < 0) throw py::value_error(std::string(what) + "[" + std::to_string(i) + "] is negative (" +
                                          std::to_string(p[i]) + "); ids are unsigned 64-bit");
  }
  auto ids = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!ids) throw py::error_already_set();
  return ids;  // any shape: its elements in C order are the ids
}

FloatArray to_floats(const py::handle& obj, const char* what, size_t expect, size_t n, uint32_t dim) {
  py::array a = as_array(obj);
  const char kind = a.dtype().kind();
  if (kind != 'f' && kind != 'i' && kind != 'u')
    throw py::type_error(std::string(what) + " must be a float array, got dtype " + py::str(a.dtype()).cast<std::string>());
  auto f = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!f) throw py::error_already_set();
  if (static_cast<size_t>(f.size()) != expect)
    throw py::value_error(std::string(what) + " has " + std::to_string(f.size()) + " elements; " + std::to_string(n) +
                          " ids of dim " + std::to_string(dim) + " need " + std::to_string(expect));
  return f;
}

// An output array for n rows of dim floats: `out` when given (float32, C-contiguous, writable, right
// size), else a new (n, dim) array.
FloatArray rows_out(const py::object& out, size_t n, uint32_t dim) {
  if (out.is_none()) return FloatArray({static_cast<py::ssize_t>(n), static_cast<py::ssize_t>(dim)});
  if (!py::isinstance<FloatArray>(out))
    throw py::type_error("out must be a float32 numpy array");
  auto a = py::reinterpret_borrow<py::array>(out);
  if (!(a.flags() & py::array::c_style) || !a.writeable())
    throw py::value_error("out must be C-contiguous and writable");
  if (static_cast<size_t>(a.size()) != n * dim)
    throw py::value_error("out has " + std::to_string(a.size()) + " elements; " + std::to_string(n) + " rows of dim " +
                          std::to_string(dim) + " need " + std::to_string(n * dim));
  return py::reinterpret_borrow<FloatArray>(out);
}

// ---- table configuration <-> Python ----
// Names: one home, src/ps/config_json.h (InvalidArgument arrives in Python as a ValueError).
using ps::init_name;
using ps::optimizer_name;
using ps::storage_name;

// A float as Python should show it: 0.01, not 0.009999999776482582.
double shortest(float f) { return std::stod(fmt::format("{}", f)); }

py::dict config_dict(const ps::TableConfig& c) {
  py::dict d;
  d["dim"] = c.dim;
  d["dense"] = c.dense;
  d["rows"] = c.rows;
  d["expected_rows"] = c.expected_rows;
  d["storage"] = storage_name(c.storage);
  d["optimizer"] = optimizer_name(c.optimizer);
  d["lr"] = shortest(c.lr);
  d["beta1"] = shortest(c.beta1);
  d["beta2"] = shortest(c.beta2);
  d["eps"] = shortest(c.eps);
  d["initial_accumulator"] = shortest(c.initial_accumulator);
  d["init"] = init_name(c.init);
  d["init_a"] = shortest(c.init_a);
  d["init_b"] = shortest(c.init_b);
  d["seed"] = c.seed;
  return d;
}

// ---- the client ----
// Calls run without the GIL on a shared_ptr copy of the client, so close() from another thread
// cannot free it under a running call (the last holder closes it). client_ itself is only read or
// written with the GIL held.
class PyClient;
std::set<PyClient*> g_open;  // clients not yet closed (the atexit hook closes them); GIL-protected

class PyClient {
 public:
  explicit PyClient(std::shared_ptr<ps::Client> client) : client_(std::move(client)) { g_open.insert(this); }
  ~PyClient() { close(); }
  PyClient(const PyClient&) = delete;
  PyClient& operator=(const PyClient&) = delete;

  static std::unique_ptr<PyClient> from_env() {
    std::shared_ptr<ps::Client> c;
    {
      py::gil_scoped_release no_gil;
      c = ps::Client::from_env();
    }
    return std::make_unique<PyClient>(std::move(c));
  }

  std::shared_ptr<ps::Client> c() const {
    if (!client_) throw py::value_error("this cohort_ps.Client is closed");
    return client_;
  }

  // Closing says goodbye to the servers: done without the GIL.
  void close() {
    g_open.erase(this);
    std::shared_ptr<ps::Client> last = std::move(client_);
    client_.reset();
    if (!last || !PyGILState_Check()) return;
    py::gil_scoped_release no_gil;
    last.reset();
  }
  bool closed() const { return !client_; }

  uint32_t dim(const std::string& table) {
    auto it = dims_.find(table);
    if (it != dims_.end()) return it->second;
    auto client = c();
    ps::TableConfig config;
    {
      py::gil_scoped_release no_gil;
      config = client->table(table);
    }
    dims_[table] = config.dim;
    return config.dim;
  }

  void create_table(const std::string& name, const ps::TableConfig& config) {
    auto client = c();
    {
      py::gil_scoped_release no_gil;
      client->create_table(name, config);
    }
    dims_[name] = config.dim;
  }

  py::dict table(const std::string& name) {
    auto client = c();
    ps::TableConfig config;
    {
      py::gil_scoped_release no_gil;
      config = client->table(name);
    }
    return config_dict(config);
  }

  FloatArray pull(const std::string& table, const py::object& ids_obj, const py::object& out) {
    auto client = c();
    const uint32_t d = dim(table);
    IdArray ids = to_ids(ids_obj, "ids");
    const size_t n = static_cast<size_t>(ids.size());
    FloatArray rows = rows_out(out, n, d);
    const uint64_t* ip = ids.data();
    float* rp = rows.mutable_data();
    {
      py::gil_scoped_release no_gil;
      client->pull(table, ip, n, rp);
    }
    return rows;
  }

  void push(const std::string& table, const py::object& ids_obj, const py::object& grads_obj) {
    auto client = c();
    const uint32_t d = dim(table);
    IdArray ids = to_ids(ids_obj, "ids");
    const size_t n = static_cast<size_t>(ids.size());
    FloatArray grads = to_floats(grads_obj, "grads", n * d, n, d);
    const uint64_t* ip = ids.data();
    const float* gp = grads.data();
    py::gil_scoped_release no_gil;
    client->push(table, ip, n, gp);
  }

  FloatArray push_pull(const std::string& table, const py::object& push_ids_obj, const py::object& grads_obj,
                       const py::object& pull_ids_obj, const py::object& out) {
    auto client = c();
    const uint32_t d = dim(table);
    IdArray push_ids = to_ids(push_ids_obj, "push_ids");
    const size_t n = static_cast<size_t>(push_ids.size());
    FloatArray grads = to_floats(grads_obj, "grads", n * d, n, d);
    IdArray pull_ids = to_ids(pull_ids_obj, "pull_ids");
    const size_t m = static_cast<size_t>(pull_ids.size());
    FloatArray rows = rows_out(out, m, d);
    const uint64_t* pp = push_ids.data();
    const float* gp = grads.data();
    const uint64_t* qp = pull_ids.data();
    float* rp = rows.mutable_data();
    {
      py::gil_scoped_release no_gil;
      client->push_pull(table, pp, n, gp, qp, m, rp);
    }
    return rows;
  }

  void step() {
    auto client = c();
    py::gil_scoped_release no_gil;
    client->step();
  }

  void save(const std::string& dir) {
    auto client = c();
    py::gil_scoped_release no_gil;
    client->save(dir);
  }

  void load(const std::string& dir) {
    auto client = c();
    py::gil_scoped_release no_gil;
    client->load(dir);
  }

  py::dict stats(const std::string& table) {
    auto client = c();
    ps::TableStats s;
    {
      py::gil_scoped_release no_gil;
      s = client->stats(table);
    }
    py::dict d;
    d["rows"] = s.rows;
    d["bytes"] = s.bytes;
    d["applied_rows"] = s.applied_rows;
    d["direct_applied_rows"] = s.direct_applied_rows;
    return d;
  }

 private:
  std::shared_ptr<ps::Client> client_;
  std::map<std::string, uint32_t> dims_;
};

void close_all_open() {
  const std::set<PyClient*> open = g_open;
  for (PyClient* c : open) c->close();
}

}  // namespace cohort_ps

PYBIND11_MODULE(cohort_ps, m) {
  using cohort_ps::PyClient;
  m.doc() = "cohort's parameter-server client on numpy arrays (run under `cohort run --ps N`)";

  // Exceptions: cohort's classes, with Python's matching builtins as second bases.
  static py::exception<cohort::Error> error(m, "Error", PyExc_RuntimeError);
  auto subclass = [&](const char* name, PyObject* extra_base) {
    // Both arms as py::tuple: pybind11 3 gives make_tuple typed results that differ per arity.
    py::tuple bases = extra_base ? py::tuple(py::make_tuple(error, py::handle(extra_base))) : py::tuple(py::make_tuple(error));
    std::string qualified = std::string("cohort_ps.") + name;
    PyObject* type = PyErr_NewException(qualified.c_str(), bases.ptr(), nullptr);
    if (!type) throw py::error_already_set();
    m.attr(name) = py::reinterpret_steal<py::object>(type);
    return type;
  };
  static PyObject* invalid_argument = subclass("InvalidArgument", PyExc_ValueError);
  static PyObject* config_error = subclass("ConfigError", nullptr);
  static PyObject* timeout_error = subclass("TimeoutError", PyExc_TimeoutError);
  static PyObject* peer_lost = subclass("PeerLostError", nullptr);
  static PyObject* mismatch = subclass("MismatchError", nullptr);
  static PyObject* auth = subclass("AuthError", nullptr);
  static PyObject* aborted = subclass("AbortedError", nullptr);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const cohort::InvalidArgument& e) {
      PyErr_SetString(invalid_argument, e.what());
    } catch (const cohort::ConfigError& e) {
      PyErr_SetString(config_error, e.what());
    } catch (const cohort::TimeoutError& e) {
      PyErr_SetString(timeout_error, e.what());
    } catch (const cohort::PeerLostError& e) {
      PyErr_SetString(peer_lost, e.what());
    } catch (const cohort::MismatchError& e) {
      PyErr_SetString(mismatch, e.what());
    } catch (const cohort::AuthError& e) {
      PyErr_SetString(auth, e.what());
    } catch (const cohort::AbortedError& e) {
      PyErr_SetString(aborted, e.what());
    } catch (const cohort::Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  const ps::TableConfig defaults;
  py::class_<PyClient>(m, "Client",
                       "A worker's connection to every parameter server. Calls release the GIL while they wait; "
                       "one client may be used from several threads (calls are serialised).")
      .def_static("from_env", &PyClient::from_env,
                  "The worker side of a launched job (COHORT_ROLE=worker, `cohort run --ps N ...`).")
      .def("worker_index", [](PyClient& c) { return c.c()->worker_index(); }, "This worker's index, 0..num_workers()-1.")
      .def("num_workers", [](PyClient& c) { return c.c()->num_workers(); })
      .def("num_servers", [](PyClient& c) { return c.c()->num_servers(); })
      .def("mode", [](PyClient& c) { return c.c()->mode().to_string(); }, "The job's consistency: async, bsp or stale:K.")
      .def("clock", [](PyClient& c) { return c.c()->clock(); }, "Steps this worker has ended.")
      .def(
          "create_table",
          [](PyClient& c, const std::string& name, uint32_t dim, bool dense, uint64_t rows, const std::string& storage,
             const std::string& optimizer, float lr, float beta1, float beta2, float eps, float initial_accumulator,
             const std::string& init, float init_a, float init_b, uint64_t seed, uint64_t expected_rows) {
            ps::TableConfig config;
            config.dim = dim;
            config.dense = dense;
            config.rows = rows;
            config.storage = ps::storage_from_name(storage);
            config.optimizer = ps::optimizer_from_name(optimizer);
            config.lr = lr;
            config.beta1 = beta1;
            config.beta2 = beta2;
            config.eps = eps;
            config.initial_accumulator = initial_accumulator;
            config.init = ps::init_from_name(init);
            config.init_a = init_a;
            config.init_b = init_b;
            config.seed = seed;
            config.expected_rows = expected_rows;
            c.create_table(name, config);
          },
          py::arg("name"), py::kw_only(), py::arg("dim") = defaults.dim, py::arg("dense") = defaults.dense,
          py::arg("rows") = defaults.rows, py::arg("storage") = "float32", py::arg("optimizer") = "sgd",
          py::arg("lr") = cohort_ps::shortest(defaults.lr), py::arg("beta1") = cohort_ps::shortest(defaults.beta1),
          py::arg("beta2") = cohort_ps::shortest(defaults.beta2), py::arg("eps") = cohort_ps::shortest(defaults.eps),
          py::arg("initial_accumulator") = cohort_ps::shortest(defaults.initial_accumulator),
          py::arg("init") = "zeros", py::arg("init_a") = cohort_ps::shortest(defaults.init_a),
          py::arg("init_b") = cohort_ps::shortest(defaults.init_b), py::arg("seed") = defaults.seed,
          py::arg("expected_rows") = defaults.expected_rows,
          "Declares a table (every worker may; declarations that differ raise InvalidArgument naming the field).\n"
          "storage: float32, float16 or bfloat16; optimizer: sgd, adagrad or adam; init: zeros, constant (init_a) "
          "or uniform [init_a, init_b). expected_rows (sparse tables): rows expected in all, so that the "
          "servers' indexes are sized for them from the start.")
      .def("table", &PyClient::table, py::arg("name"), "A table's configuration, as a dict.")
      .def("pull", &PyClient::pull, py::arg("table"), py::arg("ids"), py::arg("out") = py::none(),
           "Rows of `ids` (integer array, any shape: flattened) as a float32 array (n, dim); `out` (float32, "
           "C-contiguous, n * dim elements) is filled instead of a new array.")
      .def("push", &PyClient::push, py::arg("table"), py::arg("ids"), py::arg("grads"),
           "Gradients of `ids` (n * dim floats, e.g. shape (n, dim)); duplicate ids are summed.")
      .def("push_pull", &PyClient::push_pull, py::arg("table"), py::arg("push_ids"), py::arg("grads"),
           py::arg("pull_ids"), py::arg("out") = py::none(),
           "push(push_ids, grads), step(), pull(pull_ids) in one round trip per server; returns the pulled rows.")
      .def("step", &PyClient::step, "Ends this worker's step (the clock of bsp and stale modes).")
      .def("save", &PyClient::save, py::arg("dir"), "Every server saves its shards to `dir`, then this worker writes the manifest.")
      .def("load", &PyClient::load, py::arg("dir"), "Loads tables saved by save(), whatever the server count that saved them.")
      .def("stats", &PyClient::stats, py::arg("table"), "{'rows', 'bytes', 'applied_rows', 'direct_applied_rows'} summed over the servers.")
      .def("close", &PyClient::close, "Closes the connections; the servers stop once every worker has closed.")
      .def_property_readonly("closed", &PyClient::closed)
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyClient& c, py::args) { c.close(); });

  m.def(
      "serve_from_env", [] { ps::serve_from_env(); }, py::call_guard<py::gil_scoped_release>(),
      "Runs this process as a server (COHORT_ROLE=server, `cohort run --ps N --ps-server program`) until every "
      "worker has closed its client.");
  m.def("shard_of_id", &ps::shard_of_id, py::arg("id"), py::arg("num_servers"), "The server that holds a sparse id.");
  m.def("shard_of_row", &ps::shard_of_row, py::arg("row"), py::arg("rows"), py::arg("num_servers"),
        "The server that holds a dense table's row.");

  // Clients still open at exit are closed, so that the servers see a worker leave, not one lost.
  m.def("_close_all", &cohort_ps::close_all_open);
  py::module_::import("atexit").attr("register")(m.attr("_close_all"));
}
