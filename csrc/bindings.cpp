// pybind11 module megatron_peakflat._C: bindings only; the code lives in host_pool.cpp and cpu_adam.cpp.
#include <torch/extension.h>

#include "cpu_adam.h"
#include "host_pool.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-peakflat native parts: pinned host pool and host AdamW kernel";
#ifdef PEAKFLAT_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  m.def("adamw_step", &peakflat::adamw_step, "AdamW step on flat CPU buffers, ATen fused CPU AdamW arithmetic",
        py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_out"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("step"),
        py::arg("threads"), py::call_guard<py::gil_scoped_release>());
  m.def("adamw_isa", &peakflat::adamw_isa);
  py::class_<peakflat::HostPool, std::shared_ptr<peakflat::HostPool>>(m, "HostPool")
      .def(py::init(&peakflat::HostPool::create), py::arg("bytes"), py::arg("pin"),
           py::call_guard<py::gil_scoped_release>())
      .def("carve", &peakflat::HostPool::carve, py::arg("numel"), py::arg("dtype"))
      .def_property_readonly("capacity", &peakflat::HostPool::capacity)
      .def_property_readonly("used", &peakflat::HostPool::used)
      .def_property_readonly("pinned", &peakflat::HostPool::pinned)
      .def_property_readonly("pin_error", &peakflat::HostPool::pin_error)
      .def_property_readonly("base_address", &peakflat::HostPool::base_address);
}
