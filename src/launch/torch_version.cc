#include "launch/torch_version.h"

#include <fmt/core.h>

#include <chrono>

#include "common/strings.h"
#include "launch/doctor_child.h"

namespace cohort::launch {
namespace {

// Finds torch as `import torch` would (sys.path, PYTHONPATH, the venv's site-packages) without running
// its __init__, and prints the version its version.py states; an empty line when there is no torch.
constexpr const char* kTorchVersionProbe =
    "import importlib.util, os, re\n"
    "spec = importlib.util.find_spec('torch')\n"
    "dirs = list(spec.submodule_search_locations or []) if spec else []\n"
    "path = os.path.join(dirs[0], 'version.py') if dirs else ''\n"
    "found = re.search(r'''__version__\\s*=\\s*['\"]([^'\"]+)''', open(path).read()) if os.path.isfile(path) else None\n"
    "print(found.group(1) if found else '')\n";

}  // namespace

std::optional<std::string> installed_torch_version(const std::string& python, double timeout_s, std::string& why) {
  doctor::ChildResult r;
  try {
    r = doctor::run_child({python, "-c", kTorchVersionProbe},
                          Deadline::after(std::chrono::duration_cast<std::chrono::nanoseconds>(
                              std::chrono::duration<double>(timeout_s))));
  } catch (const std::exception& e) {
    why = fmt::format("{} could not be asked for its torch ({})", python, e.what());
    return std::nullopt;
  }
  if (r.timed_out) {
    why = fmt::format("{} did not say which torch it has within {:g} s", python, timeout_s);
    return std::nullopt;
  }
  const std::string version(str::trim(r.out));
  if (r.exit_code != 0 || version.find('\n') != std::string::npos) {
    why = fmt::format("{} could not be asked for its torch (exit code {})", python, r.exit_code);
    return std::nullopt;
  }
  if (version.empty()) {
    why = fmt::format("{} has no torch", python);
    return std::nullopt;
  }
  return version;
}

void choose_local_rank_arg(Plan& plan) {
  ProgramForm& form = plan.form;
  if (!form.append_local_rank || form.local_rank_arg_source != "auto") return;
  form.local_rank_arg = "--local_rank";
  if (form.kind == "direct") {
    form.local_rank_arg_source = "auto: the program runs directly, so no torch to ask; torch 1.x's spelling";
    return;
  }
  std::string why;
  const auto version = installed_torch_version(plan.program_path, 20, why);
  if (!version) {
    form.local_rank_arg_source = fmt::format("auto: {}; torch 1.x's spelling", why);
    return;
  }
  // torch 2.0's launch switched to the dashed spelling ("2.1.0+cu121": the major number before the dot).
  int major = 0;
  for (char c : *version) {
    if (c < '0' || c > '9' || major > 1000) break;
    major = major * 10 + (c - '0');
  }
  if (major >= 2) form.local_rank_arg = "--local-rank";
  form.local_rank_arg_source = fmt::format("auto: torch {} of {}", *version, plan.program_path);
}

}  // namespace cohort::launch
