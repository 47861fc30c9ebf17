//! A table of bad inputs and faults against the public API and both examples' command lines.
//! Each row asserts the specific typed error, or the documented recovery, and that the process
//! did not crash: rows that could kill a process (the loader's) run in a child process, the
//! rest under `catch_unwind`. The test prints the table's totals.

mod amp;
mod cache_files;
mod cache_folders;
#[path = "../common/mod.rs"]
mod common;
mod configs;
mod env;
mod examples;
mod graph;
mod library_files;
mod loader;
mod nets;
mod programs;
mod props;
mod props_files;

use amp::*;
use cache_files::*;
use cache_folders::*;
use configs::*;
use env::*;
use examples::*;
use graph::*;
use library_files::*;
use loader::*;
use nets::*;
use programs::*;
use props::*;
use props_files::*;

use cudnn_cbr::amp::plan::{MemoryPlanBuilder, ParamKind, Region};
use cudnn_cbr::amp::range::{LossScalePolicy, Scalars, SgdConfig};
use cudnn_cbr::amp::step::AmpExecutor;
use cudnn_cbr::amp::step::{AmpStep, CpuRegions, StepConfig};
use cudnn_cbr::amp::RangeOpError;
use cudnn_cbr::amp::{AmpError, PlanError};
use cudnn_cbr::dist::bootstrap::{read_id_file, write_id_file, LaunchEnv};
use cudnn_cbr::dist::nccl::{
    nccl_candidates, NcclCandidate, NcclLibrary, NCCL_LIB_DIR_ENV, NCCL_PATH_ENV,
};
use cudnn_cbr::dist::watchdog::parse_timeout;
use cudnn_cbr::dist::{CpuGroup, CpuReplica, DistError};
use cudnn_cbr::fusion::cache::PlanCache;
use cudnn_cbr::fusion::cbr::kernels::Pointwise;
use cudnn_cbr::fusion::cbr::RouteKind;
use cudnn_cbr::fusion::cbr::{CbrConfig, CbrLayer, ConvShape, HostBuffers, Pass};
use cudnn_cbr::fusion::graph::{
    ConvAttrs, Graph, GraphError, PointwiseAttrs, PointwiseMode, ReductionAttrs, ReductionMode,
    TensorAttrs,
};
use cudnn_cbr::fusion::reference::Nhwc;
use cudnn_cbr::fusion::{DeviceProps, Error, Target};
use cudnn_cbr::net::{
    compile, BlockKind, BlockSpec, CpuNet, NetSpec, PoolSpec, Preset, RoutePolicy,
};
use cudnn_cbr::net::{max_pool, max_pool_backward};
use cudnn_cbr::sys::{load_from, LoadError, SearchPaths};
use cudnn_cbr::{classifier::ClassifierError, classifier::CpuClassifier};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How a row ended when it met its expectation.
enum Verdict {
    /// The specific typed error the row expects (its text, for the printout).
    Typed(String),
    /// The documented recovery (what happened).
    Recovered(String),
}

type Row = (&'static str, &'static str, fn() -> Verdict);

fn typed(e: impl std::fmt::Display) -> Verdict {
    Verdict::Typed(e.to_string().lines().next().unwrap_or_default().to_string())
}

#[test]
fn every_bad_input_is_a_typed_error_or_a_documented_recovery() {
    let rows: Vec<Row> = [
        graph_rows(),
        config_rows(),
        props_rows(),
        cache_rows(),
        loader_rows(),
        amp_rows(),
        example_rows(),
        route_rows(),
        head_rows(),
        group_rows(),
        library_rows(),
        env_rows(),
        props_more_rows(),
        cache_folder_rows(),
        program_rows(),
    ]
    .concat();
    let (mut errors, mut recoveries, mut failures) = (0, 0, Vec::new());
    println!("{:<17} {:<60} outcome", "area", "input");
    for (area, what, row) in &rows {
        match catch_unwind(AssertUnwindSafe(row)) {
            Ok(Verdict::Typed(msg)) => {
                errors += 1;
                println!("{area:<17} {what:<60} typed error: {msg}");
            }
            Ok(Verdict::Recovered(msg)) => {
                recoveries += 1;
                println!("{area:<17} {what:<60} recovered: {msg}");
            }
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                println!("{area:<17} {what:<60} FAILED: {msg}");
                failures.push(format!("{area}: {what}: {msg}"));
            }
        }
    }
    println!(
        "totals: {} rows: {errors} typed errors / {recoveries} documented recoveries / {} failures (crashes 0: every row ran to its end)",
        rows.len(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(rows.len() >= 250, "the table has {} rows", rows.len());
}
