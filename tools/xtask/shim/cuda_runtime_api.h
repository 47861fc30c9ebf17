/* Stand-in for the CUDA runtime header while generating cudnn-fe-sys: cudnn_graph.h needs only
 * these two opaque handle types and size_t from it (and library_types.h, which is taken as shipped). */
#ifndef CUDNN_CBR_SHIM_CUDA_RUNTIME_API_H
#define CUDNN_CBR_SHIM_CUDA_RUNTIME_API_H
#include <stddef.h>
typedef struct CUstream_st *cudaStream_t;
typedef struct CUgraph_st *cudaGraph_t;
#endif
