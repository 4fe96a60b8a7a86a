#include <errno.h>
#include <omp.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sched.h>

#include <vector>

// Pin the calling thread's OpenMP team, thread i to cpus[i] (thread 0 is the caller).
//
// The team is the one torch's own parallel regions and oneDNN then reuse: libgomp keeps a
// master thread's pool of worker threads between regions of the same size, so the pins
// hold for every later region of torch.get_num_threads() threads started by this thread.
// Returns one status per thread: 0 (pinned), an errno, or -1 where the runtime gave the
// region fewer threads than asked (nothing is pinned then but the threads that ran).
std::vector<int> bind_team(const std::vector<int>& cpus) {
  const int n = static_cast<int>(cpus.size());
  std::vector<int> status(n, -1);
  if (n == 0) return status;
#pragma omp parallel num_threads(n)
  {
    const int t = omp_get_thread_num();
    if (t < n) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[t], &set);
      status[t] = sched_setaffinity(0, sizeof(set), &set) == 0 ? 0 : errno;
    }
  }
  return status;
}

// Release the calling thread's OpenMP team (its pooled worker threads end; a later region
// there starts a new one). libgomp lets a team's idle threads spin before they sleep, but
// only while it manages no more threads than there are CPUs: one other thread's idle team
// (say, the one that loaded the model) makes every team sleep at once after each region,
// and each of a step's hundreds of regions then waits out a wake-up (80 us against 16 us
// per region here). Returns 0 on success.
int release_team() { return omp_pause_resource_all(omp_pause_soft); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind_team", &bind_team, "pin the caller's OpenMP team, one thread per CPU");
  m.def("release_team", &release_team, "end the caller's OpenMP team's pooled threads");
}
