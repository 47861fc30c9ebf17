//! The multi-process bootstrap on the CPU: launcher environments, and rank 0's id reaching
//! every rank over a TCP store on 127.0.0.1 or a rendezvous file (ranks as threads).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use cudnn_cbr_dist::bootstrap::{
    exchange_id, fetch_id, read_id_file, write_id_file, IdServer, LaunchEnv, Launcher, Rendezvous,
    DEFAULT_PORT,
};
use cudnn_cbr_dist::nccl::{NcclId, NCCL_ID_BYTES};
use cudnn_cbr_dist::DistError;

const WAIT: Duration = Duration::from_secs(5);

fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

fn id_bytes(seed: u8) -> [u8; NCCL_ID_BYTES] {
    std::array::from_fn(|i| (i as u8).wrapping_mul(31) ^ seed)
}

/// A port nothing listens on (bound, then released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("amp-dist-bootstrap-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn store_problem(e: &DistError) -> &str {
    match e {
        DistError::Store { problem, .. } => problem,
        other => panic!("expected a store error, got {other}"),
    }
}

#[test]
fn torchrun_variables_give_rank_world_locals_and_the_store() {
    let env = LaunchEnv::from_vars(vars(&[
        ("RANK", "9"),
        ("WORLD_SIZE", "16"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "8"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29501"),
        // A torchrun inside an MPI job: torchrun's variables win.
        ("OMPI_COMM_WORLD_RANK", "0"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
    ]))
    .unwrap();
    assert_eq!(env.launcher, Launcher::Torch);
    assert_eq!((env.rank, env.world), (9, 16));
    assert_eq!((env.local_rank, env.local_world), (Some(1), Some(8)));
    assert_eq!(
        env.rendezvous,
        Some(Rendezvous::Tcp {
            host: "node0".into(),
            port: 29501
        })
    );
}

#[test]
fn mpi_and_slurm_variables_are_read_in_their_order() {
    let ompi = LaunchEnv::from_vars(vars(&[
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("PMI_RANK", "0"),
        ("PMI_SIZE", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
    ]))
    .unwrap();
    assert_eq!(ompi.launcher, Launcher::OpenMpi);
    assert_eq!(
        (ompi.rank, ompi.world, ompi.local_rank, ompi.local_world),
        (3, 4, Some(1), Some(2))
    );
    assert_eq!(
        ompi.rendezvous,
        Some(Rendezvous::Tcp {
            host: "10.0.0.1".into(),
            port: DEFAULT_PORT
        })
    );

    let pmi = LaunchEnv::from_vars(vars(&[
        ("PMI_RANK", "2"),
        ("PMI_SIZE", "3"),
        ("MPI_LOCALRANKID", "0"),
    ]))
    .unwrap();
    assert_eq!(pmi.launcher, Launcher::Pmi);
    assert_eq!(
        (pmi.rank, pmi.world, pmi.local_rank, pmi.local_world),
        (2, 3, Some(0), None)
    );
    assert_eq!(pmi.rendezvous, None);

    let slurm = LaunchEnv::from_vars(vars(&[
        ("SLURM_PROCID", "15"),
        ("SLURM_NTASKS", "16"),
        ("SLURM_LOCALID", "7"),
        ("SLURM_NTASKS_PER_NODE", "8"),
        ("SLURM_JOB_NODELIST", "gpu[07-08]"),
    ]))
    .unwrap();
    assert_eq!(slurm.launcher, Launcher::Slurm);
    assert_eq!(
        (slurm.rank, slurm.world, slurm.local_rank, slurm.local_world),
        (15, 16, Some(7), Some(8))
    );
    assert_eq!(
        slurm.rendezvous,
        Some(Rendezvous::Tcp {
            host: "gpu07".into(),
            port: DEFAULT_PORT
        })
    );

    // A node list that is not simple needs MASTER_ADDR; a rendezvous file wins over both.
    let odd = LaunchEnv::from_vars(vars(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "a[1-2]b[3-4]"),
    ]))
    .unwrap();
    assert_eq!(odd.rendezvous, None);
    let file = LaunchEnv::from_vars(vars(&[
        ("SLURM_PROCID", "0"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_JOB_NODELIST", "n1"),
        ("CUDNN_CBR_RENDEZVOUS_FILE", "/shared/job7.id"),
    ]))
    .unwrap();
    assert_eq!(
        file.rendezvous,
        Some(Rendezvous::File("/shared/job7.id".into()))
    );
}

#[test]
fn bad_launcher_values_are_typed_errors_naming_the_variable() {
    let var_of = |pairs: &[(&str, &str)]| match LaunchEnv::from_vars(vars(pairs)) {
        Err(DistError::Bootstrap {
            var,
            value,
            problem,
        }) => (var, value, problem),
        other => panic!("expected a bootstrap error, got {other:?}"),
    };
    let (var, _, problem) = var_of(&[]);
    assert_eq!(var, "RANK");
    assert!(
        problem.contains("no launcher") && problem.contains("SLURM_PROCID"),
        "{problem}"
    );

    let (var, value, problem) = var_of(&[("RANK", "4"), ("WORLD_SIZE", "4")]);
    assert_eq!((var.as_str(), value.as_str()), ("RANK", "4"));
    assert!(problem.contains("below the world size 4"), "{problem}");

    let (var, _, problem) = var_of(&[("OMPI_COMM_WORLD_RANK", "1")]);
    assert_eq!(var, "OMPI_COMM_WORLD_SIZE");
    assert!(problem.contains("missing"), "{problem}");

    let (var, value, _) = var_of(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "two")]);
    assert_eq!((var.as_str(), value.as_str()), ("SLURM_NTASKS", "two"));

    let (var, value, _) = var_of(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "70000"),
    ]);
    assert_eq!((var.as_str(), value.as_str()), ("MASTER_PORT", "70000"));

    let (var, _, _) = var_of(&[("RANK", "0"), ("WORLD_SIZE", "0")]);
    assert_eq!(var, "WORLD_SIZE");

    let (var, _, problem) = var_of(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "4"),
        ("LOCAL_WORLD_SIZE", "4"),
    ]);
    assert_eq!(var, "LOCAL_RANK");
    assert!(problem.contains("node's rank count 4"), "{problem}");
}

#[test]
fn a_group_of_one_makes_its_id_and_a_larger_one_needs_a_rendezvous() {
    let one = LaunchEnv::from_vars(vars(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap();
    assert_eq!(
        exchange_id(&one, || Ok(id_bytes(1)), WAIT).unwrap(),
        id_bytes(1)
    );
    assert_eq!(
        exchange_id(&LaunchEnv::single(), || Ok([7u8; 4]), WAIT).unwrap(),
        [7u8; 4]
    );

    let two = LaunchEnv::from_vars(vars(&[("RANK", "1"), ("WORLD_SIZE", "2")])).unwrap();
    let e = exchange_id(&two, || Ok(id_bytes(1)), WAIT).unwrap_err();
    assert!(
        matches!(&e, DistError::Bootstrap { var, .. } if var == "MASTER_ADDR"),
        "{e}"
    );
    assert!(e.to_string().contains("CUDNN_CBR_RENDEZVOUS_FILE"), "{e}");
}

#[test]
fn four_ranks_get_rank_0s_id_from_its_store() {
    let server = IdServer::bind("127.0.0.1:0", 4).unwrap();
    let port = server.local_addr().port().to_string();
    let id = id_bytes(0x5a);
    let peers: Vec<_> = (1..4)
        .map(|rank| {
            let port = port.clone();
            thread::spawn(move || {
                let env = LaunchEnv::from_vars(vars(&[
                    ("RANK", &rank.to_string()),
                    ("WORLD_SIZE", "4"),
                    ("MASTER_ADDR", "127.0.0.1"),
                    ("MASTER_PORT", &port),
                ]))
                .unwrap();
                // Only rank 0 makes the id.
                exchange_id(&env, || Err(DistError::EmptyGroup), WAIT)
            })
        })
        .collect();
    server.serve(&id, WAIT).unwrap();
    for p in peers {
        let got = p.join().unwrap().unwrap();
        assert_eq!(got, id);
        assert_eq!(
            NcclId::from_bytes(&got).unwrap().to_hex(),
            NcclId::from_bytes(&id).unwrap().to_hex()
        );
    }
}

#[test]
fn peers_started_before_rank_0_retry_until_it_listens() {
    let port = free_port().to_string();
    let env_of = |rank: usize| {
        LaunchEnv::from_vars(vars(&[
            ("OMPI_COMM_WORLD_RANK", &rank.to_string()),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", &port),
        ]))
        .unwrap()
    };
    let peers: Vec<_> = (1..4)
        .map(|rank| {
            let env = env_of(rank);
            thread::spawn(move || exchange_id(&env, || Err(DistError::EmptyGroup), WAIT))
        })
        .collect();
    thread::sleep(Duration::from_millis(150));
    let mine = exchange_id(&env_of(0), || Ok(id_bytes(3)), WAIT).unwrap();
    assert_eq!(mine, id_bytes(3));
    for p in peers {
        assert_eq!(p.join().unwrap().unwrap(), id_bytes(3));
    }
}

#[test]
fn mismatched_peers_are_refused_and_rank_0_still_serves_the_rest() {
    let server = IdServer::bind("127.0.0.1:0", 3).unwrap();
    let addr = server.local_addr().to_string();
    let id = id_bytes(9);
    let rank0 = thread::spawn(move || server.serve(&id, WAIT));

    // Launched with another world size: refused at once, with rank 0's reason.
    let e = fetch_id::<NCCL_ID_BYTES>(&addr, 1, 4, WAIT).unwrap_err();
    assert!(
        store_problem(&e).contains("world size 4, rank 0 with 3"),
        "{e}"
    );
    // Expecting another id length: refused.
    let e = fetch_id::<64>(&addr, 2, 3, WAIT).unwrap_err();
    assert!(store_problem(&e).contains("64-byte id"), "{e}");
    // Not one of ours (bad magic): rank 0 answers with a refusal and carries on.
    let mut raw = TcpStream::connect(&addr).unwrap();
    raw.set_read_timeout(Some(WAIT)).unwrap();
    raw.write_all(b"GET / HTTP/1.1\r\nHost: ").unwrap(); // 22 bytes, as a header
    let mut answer = Vec::new();
    raw.read_to_end(&mut answer).unwrap();
    assert_eq!(&answer[..8], b"CBRNCCL1");
    assert_eq!(answer[10], 1, "a refusal");
    assert!(String::from_utf8_lossy(&answer[15..]).contains("bad magic"));

    for rank in [1, 2] {
        assert_eq!(
            fetch_id::<NCCL_ID_BYTES>(&addr, rank, 3, WAIT).unwrap(),
            id_bytes(9)
        );
    }
    rank0.join().unwrap().unwrap();
}

#[test]
fn a_peer_refuses_a_server_that_is_not_rank_0() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let imposter = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 22];
        s.read_exact(&mut hello).unwrap();
        s.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").unwrap();
    });
    let e = fetch_id::<NCCL_ID_BYTES>(&addr, 1, 2, WAIT).unwrap_err();
    assert!(
        store_problem(&e).contains("not from a cudnn-cbr rank 0"),
        "{e}"
    );
    imposter.join().unwrap();
}

#[test]
fn a_missing_rank_0_is_a_timeout_error_in_time() {
    let addr = format!("127.0.0.1:{}", free_port());
    let limit = Duration::from_millis(300);
    let t = Instant::now();
    let e = fetch_id::<NCCL_ID_BYTES>(&addr, 1, 2, limit).unwrap_err();
    let took = t.elapsed();
    assert!(
        took >= limit && took < limit + Duration::from_secs(2),
        "{took:?}"
    );
    assert!(
        matches!(&e, DistError::Store { addr: a, .. } if *a == addr),
        "{e}"
    );
    assert!(
        store_problem(&e).contains("did not hand out the id within"),
        "{e}"
    );

    // And rank 0 names the ranks that never came.
    let server = IdServer::bind("127.0.0.1:0", 3).unwrap();
    let addr = server.local_addr().to_string();
    let one = thread::spawn(move || fetch_id::<NCCL_ID_BYTES>(&addr, 1, 3, WAIT));
    let t = Instant::now();
    let e = server
        .serve(&id_bytes(1), Duration::from_millis(400))
        .unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(store_problem(&e).contains("ranks [2] did not fetch"), "{e}");
    assert_eq!(one.join().unwrap().unwrap(), id_bytes(1));
}

#[test]
fn four_ranks_meet_through_a_rendezvous_file() {
    let dir = temp_dir("file");
    let path = dir.join("job.id");
    let path_s = path.display().to_string();
    let env_of = |rank: usize| {
        LaunchEnv::from_vars(vars(&[
            ("SLURM_PROCID", &rank.to_string()),
            ("SLURM_NTASKS", "4"),
            ("CUDNN_CBR_RENDEZVOUS_FILE", &path_s),
        ]))
        .unwrap()
    };
    let peers: Vec<_> = (1..4)
        .map(|rank| {
            let env = env_of(rank);
            thread::spawn(move || exchange_id(&env, || Err(DistError::EmptyGroup), WAIT))
        })
        .collect();
    thread::sleep(Duration::from_millis(100));
    assert_eq!(
        exchange_id(&env_of(0), || Ok(id_bytes(4)), WAIT).unwrap(),
        id_bytes(4)
    );
    for p in peers {
        assert_eq!(p.join().unwrap().unwrap(), id_bytes(4));
    }
    // Only the file itself is left: the temporary one was renamed over it.
    let names: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["job.id"]);

    // A file written for another world size is refused, not trusted.
    let e = read_id_file::<NCCL_ID_BYTES>(&path, 8, WAIT).unwrap_err();
    assert!(
        store_problem(&e).contains("world size 4, this rank has 8"),
        "{e}"
    );
    std::fs::write(&path, b"garbage that is long enough to be a header").unwrap();
    let e = read_id_file::<NCCL_ID_BYTES>(&path, 4, WAIT).unwrap_err();
    assert!(store_problem(&e).contains("bad magic"), "{e}");
    write_id_file(&path, 4, &[1, 2, 3]).unwrap();
    let e = read_id_file::<NCCL_ID_BYTES>(&path, 4, WAIT).unwrap_err();
    assert!(store_problem(&e).contains("3-byte id"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_rendezvous_file_that_never_appears_times_out() {
    let dir = temp_dir("timeout");
    let path = dir.join("never.id");
    let limit = Duration::from_millis(250);
    let t = Instant::now();
    let e = read_id_file::<NCCL_ID_BYTES>(&path, 2, limit).unwrap_err();
    let took = t.elapsed();
    assert!(
        took >= limit && took < limit + Duration::from_secs(2),
        "{took:?}"
    );
    assert!(
        store_problem(&e).contains("did not write the id within"),
        "{e}"
    );
    // Rank 0 that cannot write (its folder is missing) says so.
    let e = write_id_file(&dir.join("no/such/dir/x.id"), 2, &[0; 4]).unwrap_err();
    assert!(store_problem(&e).contains("cannot write"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
