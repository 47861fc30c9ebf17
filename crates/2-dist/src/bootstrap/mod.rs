//! Starting a multi-process group: which rank this process is, from the launcher's
//! environment ([`LaunchEnv`]), and how rank 0's communicator id reaches the others
//! ([`exchange_id`]: a TCP store on rank 0, or a shared rendezvous file).
//!
//! # Launchers
//! [`LaunchEnv::from_env`] reads the first of these that is present, in this order:
//!
//! | launcher | rank | world size | local rank | local world size |
//! |----------|------|------------|------------|------------------|
//! | torchrun / `torch.distributed` | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `LOCAL_WORLD_SIZE` |
//! | Open MPI (`mpirun`) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_COMM_WORLD_LOCAL_SIZE` |
//! | MPICH / Hydra, Intel MPI | `PMI_RANK` | `PMI_SIZE` | `MPI_LOCALRANKID` | `MPI_LOCALNRANKS` |
//! | Slurm (`srun`) | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | `SLURM_NTASKS_PER_NODE` |
//!
//! The rendezvous ([`Rendezvous`]) is `CUDNN_CBR_RENDEZVOUS_FILE` when set (a path every rank
//! sees, e.g. on a shared file system), else `MASTER_ADDR`:`MASTER_PORT` (port
//! [`DEFAULT_PORT`] when only the address is set). Under Slurm without `MASTER_ADDR`, the
//! first host of `SLURM_JOB_NODELIST` is used when it is a plain name or a single bracket
//! range (`gpu[01-04]` → `gpu01`); anything else needs `MASTER_ADDR`. A group of one rank
//! needs no rendezvous.
//!
//! # Two nodes with eight GPUs each
//! torchrun, on each node `N` in 0, 1:
//! ```text
//! torchrun --nnodes 2 --nproc-per-node 8 --node-rank $N --master-addr <host0> \
//!     --master-port 29500 target/release/examples/train_cbr --device cuda ...
//! ```
//! Slurm (the rank-0 host as the store):
//! ```text
//! export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
//! export MASTER_PORT=29500
//! srun -N 2 --ntasks-per-node 8 --gpus-per-task 1 target/release/examples/train_cbr --device cuda ...
//! ```
//! Each process takes GPU `local_rank` (with `--gpus-per-task 1` Slurm shows each task only
//! its own GPU: device 0).
//!
//! # The TCP store
//! Rank 0 listens on `MASTER_PORT` on all its interfaces ([`IdServer`]; the other ranks
//! connect to `MASTER_ADDR:MASTER_PORT`) until every other rank has
//! fetched the id ([`fetch_id`]). A peer opens with a header: the magic `CBRNCCL1`, the
//! protocol version, its rank, the world size it was launched with, and the id length it
//! expects; rank 0 answers with its own magic and version and either the id or a refusal
//! saying why (another world size, a rank out of range, another id length). A peer that is
//! refused fails at once ([`DistError::Store`]); rank 0 keeps waiting for the real ranks.
//! Peers retry the connection until their timeout, so they may start before rank 0.

use std::path::PathBuf;

use super::DistError;

mod exchange;

pub use exchange::{exchange_id, fetch_id, read_id_file, write_id_file, IdServer};

/// The port of the TCP store when `MASTER_ADDR` is set without `MASTER_PORT` (torchrun's).
pub const DEFAULT_PORT: u16 = 29500;

/// The variable naming a rendezvous file; it takes precedence over `MASTER_ADDR`.
pub const RENDEZVOUS_FILE_ENV: &str = "CUDNN_CBR_RENDEZVOUS_FILE";

/// How long the ranks of a launched group wait for each other to share the NCCL id.
pub const RENDEZVOUS_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Which launcher started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun or another `torch.distributed` launcher (`RANK`, `WORLD_SIZE`).
    Torch,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// MPICH's Hydra or Intel MPI (`PMI_RANK`, `PMI_SIZE`).
    Pmi,
    /// Slurm's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`).
    Slurm,
}

/// Where the ranks meet to share rank 0's id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rendezvous {
    /// A TCP store on rank 0.
    Tcp {
        /// Rank 0's host name or address.
        host: String,
        /// The port rank 0 listens on.
        port: u16,
    },
    /// A file every rank sees: rank 0 writes it, the others wait for it.
    File(PathBuf),
}

impl Rendezvous {
    /// The store's address (`host:port`, IPv6 hosts in brackets), or the file's path.
    pub fn addr(&self) -> String {
        match self {
            Rendezvous::Tcp { host, port } if host.contains(':') && !host.starts_with('[') => {
                format!("[{host}]:{port}")
            }
            Rendezvous::Tcp { host, port } => format!("{host}:{port}"),
            Rendezvous::File(p) => p.display().to_string(),
        }
    }
}

/// This process's place in the group, as its launcher described it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LaunchEnv {
    /// The launcher whose variables were read.
    pub launcher: Launcher,
    /// This rank, in `0..world`.
    pub rank: usize,
    /// How many ranks the group has.
    pub world: usize,
    /// This rank among the ranks of its node (its GPU), when the launcher says.
    pub local_rank: Option<usize>,
    /// How many ranks run on this node, when the launcher says.
    pub local_world: Option<usize>,
    /// Where the ranks meet; `None` when nothing names it.
    pub rendezvous: Option<Rendezvous>,
}

/// The variables of one launcher.
struct Vars {
    launcher: Launcher,
    rank: &'static str,
    world: &'static str,
    local_rank: &'static str,
    local_world: &'static str,
}

const LAUNCHERS: [Vars; 4] = [
    Vars {
        launcher: Launcher::Torch,
        rank: "RANK",
        world: "WORLD_SIZE",
        local_rank: "LOCAL_RANK",
        local_world: "LOCAL_WORLD_SIZE",
    },
    Vars {
        launcher: Launcher::OpenMpi,
        rank: "OMPI_COMM_WORLD_RANK",
        world: "OMPI_COMM_WORLD_SIZE",
        local_rank: "OMPI_COMM_WORLD_LOCAL_RANK",
        local_world: "OMPI_COMM_WORLD_LOCAL_SIZE",
    },
    Vars {
        launcher: Launcher::Pmi,
        rank: "PMI_RANK",
        world: "PMI_SIZE",
        local_rank: "MPI_LOCALRANKID",
        local_world: "MPI_LOCALNRANKS",
    },
    Vars {
        launcher: Launcher::Slurm,
        rank: "SLURM_PROCID",
        world: "SLURM_NTASKS",
        local_rank: "SLURM_LOCALID",
        local_world: "SLURM_NTASKS_PER_NODE",
    },
];

fn bootstrap_error(var: &str, value: &str, problem: impl Into<String>) -> DistError {
    DistError::Bootstrap {
        var: var.to_string(),
        value: value.to_string(),
        problem: problem.into(),
    }
}

impl LaunchEnv {
    /// A group of one: rank 0 of 1, no rendezvous.
    pub fn single() -> Self {
        LaunchEnv {
            launcher: Launcher::Torch,
            rank: 0,
            world: 1,
            local_rank: Some(0),
            local_world: Some(1),
            rendezvous: None,
        }
    }

    /// The GPU this rank takes among the `gpus` its process sees: its local rank (its rank
    /// where the launcher names none) modulo `gpus`; device 0 for a group of one.
    pub fn device_ordinal(&self, gpus: usize) -> usize {
        if self.world <= 1 {
            return 0;
        }
        self.local_rank.unwrap_or(self.rank) % gpus.max(1)
    }

    /// Reads the process environment ([`LaunchEnv::from_vars`]).
    ///
    /// # Errors
    /// As [`LaunchEnv::from_vars`].
    pub fn from_env() -> Result<Self, DistError> {
        Self::from_vars(|v| std::env::var(v).ok())
    }

    /// Reads the variables `var` returns (the module docs list them, with their precedence):
    /// the first launcher whose rank variable is set (non-empty) is the one used.
    ///
    /// # Errors
    /// [`DistError::Bootstrap`] naming the variable: no launcher's rank variable is set, the
    /// world size is missing, a value is not a number (or a port), the world size is 0, or a
    /// rank is not below its world size.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, DistError> {
        let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
        let Some(l) = LAUNCHERS.iter().find(|l| get(l.rank).is_some()) else {
            let names: Vec<&str> = LAUNCHERS.iter().map(|l| l.rank).collect();
            return Err(bootstrap_error(
                names[0],
                "",
                format!(
                    "no launcher environment found (none of {} is set): start with torchrun, \
                     mpirun or srun, or build a group of one",
                    names.join(", ")
                ),
            ));
        };
        let number = |name: &str| -> Result<Option<usize>, DistError> {
            get(name)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| bootstrap_error(name, &v, "not a non-negative integer"))
                })
                .transpose()
        };
        let rank = number(l.rank)?.unwrap_or(0);
        let world = number(l.world)?.ok_or_else(|| {
            bootstrap_error(
                l.world,
                "",
                format!("{} is set but the world size is missing", l.rank),
            )
        })?;
        if world == 0 {
            return Err(bootstrap_error(
                l.world,
                "0",
                "a group needs at least one rank",
            ));
        }
        if rank >= world {
            return Err(bootstrap_error(
                l.rank,
                &rank.to_string(),
                format!("rank is not below the world size {world}"),
            ));
        }
        let local_rank = number(l.local_rank)?;
        let local_world = number(l.local_world)?;
        if let Some(lw) = local_world {
            if lw == 0 || lw > world {
                return Err(bootstrap_error(
                    l.local_world,
                    &lw.to_string(),
                    format!("a node's rank count must be in 1..={world}"),
                ));
            }
            if let Some(lr) = local_rank.filter(|&lr| lr >= lw) {
                return Err(bootstrap_error(
                    l.local_rank,
                    &lr.to_string(),
                    format!("local rank is not below the node's rank count {lw}"),
                ));
            }
        }
        let rendezvous = if let Some(file) = get(RENDEZVOUS_FILE_ENV) {
            Some(Rendezvous::File(PathBuf::from(file)))
        } else {
            let host = get("MASTER_ADDR")
                .map(|h| h.trim().to_string())
                .or_else(|| {
                    (l.launcher == Launcher::Slurm)
                        .then(|| get("SLURM_JOB_NODELIST").and_then(|n| first_host(&n)))
                        .flatten()
                });
            match host {
                Some(host) => {
                    let port = match get("MASTER_PORT") {
                        None => DEFAULT_PORT,
                        Some(p) => p
                            .trim()
                            .parse::<u16>()
                            .ok()
                            .filter(|&p| p != 0)
                            .ok_or_else(|| {
                                bootstrap_error("MASTER_PORT", &p, "not a port number (1..=65535)")
                            })?,
                    };
                    Some(Rendezvous::Tcp { host, port })
                }
                None => None,
            }
        };
        Ok(LaunchEnv {
            launcher: l.launcher,
            rank,
            world,
            local_rank,
            local_world,
            rendezvous,
        })
    }
}

/// The first host of a Slurm node list, when it is a plain name (`node7`, `a,b`) or has one
/// bracket range (`gpu[01-04,09]-ib` → `gpu01-ib`); `None` for anything else.
fn first_host(list: &str) -> Option<String> {
    let list = list.trim();
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0i32;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    let first = &list[..end];
    let name_ok = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
    };
    match (first.find('['), first.find(']')) {
        (None, None) => name_ok(first).then(|| first.to_string()),
        (Some(open), Some(close)) if open < close => {
            let (prefix, suffix) = (&first[..open], &first[close + 1..]);
            if suffix.contains('[') || suffix.contains(']') {
                return None;
            }
            let first_num = first[open + 1..close].split([',', '-']).next()?;
            if first_num.is_empty() || !first_num.chars().all(|c| c.is_ascii_digit()) {
                return None;
            }
            let host = format!("{prefix}{first_num}{suffix}");
            name_ok(&host).then_some(host)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_takes_its_local_rank_modulo_the_gpus_it_sees() {
        let env = |rank, world, local_rank| LaunchEnv {
            rank,
            world,
            local_rank,
            ..LaunchEnv::single()
        };
        // A group of one takes device 0, whatever its variables say.
        assert_eq!(env(0, 1, Some(3)).device_ordinal(8), 0);
        assert_eq!(env(5, 8, Some(1)).device_ordinal(4), 1);
        assert_eq!(env(5, 8, Some(6)).device_ordinal(4), 2);
        // No local rank from the launcher: the rank stands in.
        assert_eq!(env(5, 8, None).device_ordinal(4), 1);
        // A process that sees no GPU count (0) still gets an ordinal, not a division by zero.
        assert_eq!(env(3, 8, Some(3)).device_ordinal(0), 0);
    }

    #[test]
    fn slurm_node_lists_give_their_first_host_when_simple() {
        assert_eq!(first_host("node7").as_deref(), Some("node7"));
        assert_eq!(first_host("a01,b02").as_deref(), Some("a01"));
        assert_eq!(first_host("gpu[01-04]").as_deref(), Some("gpu01"));
        assert_eq!(
            first_host("gpu[09,11-12]-ib,cpu3").as_deref(),
            Some("gpu09-ib")
        );
        assert_eq!(first_host("x[1-2]y[3-4]"), None);
        assert_eq!(first_host("gpu[a-b]"), None);
        assert_eq!(first_host(""), None);
    }
    #[test]
    fn ipv6_hosts_get_brackets() {
        let r = Rendezvous::Tcp {
            host: "::1".into(),
            port: 7,
        };
        assert_eq!(r.addr(), "[::1]:7");
        let r = Rendezvous::Tcp {
            host: "h".into(),
            port: 7,
        };
        assert_eq!(r.addr(), "h:7");
    }
}
