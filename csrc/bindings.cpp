// pybind11 module megatron_peakflat._C: bindings only; the code lives in host_pool.cpp, cpu_adam.cpp and
// stream_engine.cpp (CUDA builds).
#include <torch/extension.h>

#include "cpu_adam.h"
#include "host_pool.h"
#include "stream_engine.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatron-peakflat native parts: pinned host pool, host AdamW kernel, bucket stream engine (CUDA)";
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
      .def(py::init([](int64_t bytes, bool pin) {
             // The GIL is released around the mmap and cudaHostRegister only: pybind registers the new
             // instance after the factory returns, in its shared instance map, which needs the GIL.
             py::gil_scoped_release no_gil;
             return peakflat::HostPool::create(bytes, pin);
           }),
           py::arg("bytes"), py::arg("pin"))
      .def("carve", &peakflat::HostPool::carve, py::arg("numel"), py::arg("dtype"))
      .def_property_readonly("capacity", &peakflat::HostPool::capacity)
      .def_property_readonly("used", &peakflat::HostPool::used)
      .def_property_readonly("pinned", &peakflat::HostPool::pinned)
      .def_property_readonly("pin_error", &peakflat::HostPool::pin_error)
      .def_property_readonly("base_address", &peakflat::HostPool::base_address);
#ifdef PEAKFLAT_WITH_CUDA
  py::class_<peakflat::BucketStreamer, std::shared_ptr<peakflat::BucketStreamer>>(m, "BucketStreamer")
      .def(py::init([](int64_t slots, int64_t device) {
             // torch's stream pool and events need CUDA initialised in this process (torch does it lazily).
             py::module_::import("torch.cuda").attr("init")();
             return std::make_shared<peakflat::BucketStreamer>(slots, device);
           }),
           py::arg("slots"), py::arg("device"))
      .def("upload", &peakflat::BucketStreamer::upload, py::arg("slot"), py::arg("state"), py::arg("host"),
           py::arg("start"), py::arg("numel"), py::call_guard<py::gil_scoped_release>())
      .def("write_back", &peakflat::BucketStreamer::write_back, py::arg("slot"), py::arg("state"), py::arg("host"),
           py::arg("start"), py::arg("numel"), py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &peakflat::BucketStreamer::synchronize, py::arg("slot") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("slots", &peakflat::BucketStreamer::slots)
      .def_property_readonly("device", &peakflat::BucketStreamer::device)
      .def_property_readonly("upload_stream", &peakflat::BucketStreamer::upload_stream)
      .def_property_readonly("download_stream", &peakflat::BucketStreamer::download_stream);
#endif
}
