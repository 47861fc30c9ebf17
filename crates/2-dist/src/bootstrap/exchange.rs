//! Shipping rank 0's communicator id to the other ranks: the TCP store ([`IdServer`],
//! [`fetch_id`]) and the rendezvous file ([`write_id_file`], [`read_id_file`]).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::time::{Duration, Instant};

use super::{bootstrap_error, LaunchEnv, Rendezvous, RENDEZVOUS_FILE_ENV};
use crate::DistError;

/// The first bytes of every message of the store's protocol, and of a rendezvous file.
const MAGIC: &[u8; 8] = b"CBRNCCL1";
/// The protocol's version.
const VERSION: u16 = 1;
/// The longest id the store ships.
const MAX_ID: usize = 4096;

/// Gives every rank the same id: rank 0 calls `make_id` and ships its bytes over `env`'s
/// rendezvous (an [`IdServer`] on `MASTER_ADDR:MASTER_PORT`, or the rendezvous file); the
/// other ranks fetch them. A group of one just calls `make_id`. Every rank returns within
/// about `timeout`.
///
/// # Errors
/// `make_id`'s error (rank 0); [`DistError::Bootstrap`] when a group of several has no
/// rendezvous; [`DistError::Store`] when rank 0 cannot listen or write, or a peer is
/// refused, gets a bad answer, or sees nothing within `timeout` (on rank 0: not every peer
/// came).
pub fn exchange_id<const N: usize>(
    env: &LaunchEnv,
    make_id: impl FnOnce() -> Result<[u8; N], DistError>,
    timeout: Duration,
) -> Result<[u8; N], DistError> {
    if env.world == 1 {
        return make_id();
    }
    let Some(rdv) = &env.rendezvous else {
        return Err(bootstrap_error(
            "MASTER_ADDR",
            "",
            format!(
                "a group of {} ranks needs a rendezvous: set MASTER_ADDR (and MASTER_PORT) \
                 or {RENDEZVOUS_FILE_ENV}",
                env.world
            ),
        ));
    };
    match (rdv, env.rank) {
        (Rendezvous::Tcp { host, port }, 0) => {
            // Every interface, as torch's store does: MASTER_ADDR may name this host by an
            // address it cannot bind (NAT), or resolve here to a loopback alias (127.0.1.1).
            let any = if host.parse::<std::net::Ipv6Addr>().is_ok() || host.starts_with('[') {
                format!("[::]:{port}")
            } else {
                format!("0.0.0.0:{port}")
            };
            // Listen before making the id: peers that connect early are queued, not refused.
            let server = IdServer::bind(&any, env.world)?;
            let id = make_id()?;
            server.serve(&id, timeout)?;
            Ok(id)
        }
        (Rendezvous::Tcp { .. }, rank) => fetch_id(&rdv.addr(), rank, env.world, timeout),
        (Rendezvous::File(path), 0) => {
            let id = make_id()?;
            write_id_file(path, env.world, &id)?;
            Ok(id)
        }
        (Rendezvous::File(path), _) => read_id_file(path, env.world, timeout),
    }
}

fn store_error(addr: impl std::fmt::Display, problem: impl Into<String>) -> DistError {
    DistError::Store {
        addr: addr.to_string(),
        problem: problem.into(),
    }
}

/// Rank 0's side of the TCP store: a listening socket that hands the id to each other rank.
#[derive(Debug)]
pub struct IdServer {
    listener: TcpListener,
    addr: SocketAddr,
    world: usize,
}

impl IdServer {
    /// Listens on `addr` (`host:port`; port 0 picks a free one, see
    /// [`IdServer::local_addr`]) for a group of `world` ranks.
    ///
    /// # Errors
    /// [`DistError::EmptyGroup`] for `world == 0`; [`DistError::Store`] when the address
    /// does not resolve or cannot be bound.
    pub fn bind(addr: &str, world: usize) -> Result<Self, DistError> {
        if world == 0 {
            return Err(DistError::EmptyGroup);
        }
        let listener = TcpListener::bind(addr)
            .map_err(|e| store_error(addr, format!("rank 0 cannot listen: {e}")))?;
        let local = listener
            .local_addr()
            .map_err(|e| store_error(addr, format!("rank 0 cannot listen: {e}")))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| store_error(local, format!("rank 0 cannot listen: {e}")))?;
        Ok(IdServer {
            listener,
            addr: local,
            world,
        })
    }

    /// The address it listens on (with the port picked when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Hands `id` to every rank `1..world` that asks (a rank asking twice is served twice,
    /// counted once), refusing peers with another world size, id length, magic or version,
    /// until all have it or `timeout` has passed.
    ///
    /// # Errors
    /// [`DistError::Store`] naming the ranks that never came.
    pub fn serve(self, id: &[u8], timeout: Duration) -> Result<(), DistError> {
        let deadline = Instant::now() + timeout;
        let mut served = vec![false; self.world];
        served[0] = true;
        let mut last_refusal = String::new();
        while served.iter().any(|s| !s) {
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<usize> = (0..self.world).filter(|&r| !served[r]).collect();
                let mut problem =
                    format!("ranks {missing:?} did not fetch the id within {timeout:?}");
                if !last_refusal.is_empty() {
                    problem.push_str(&format!(" (last peer refused: {last_refusal})"));
                }
                return Err(store_error(self.addr, problem));
            }
            match self.listener.accept() {
                Ok((stream, _)) => {
                    // A peer that stalls holds rank 0 up for at most this long.
                    let io_limit = (deadline - now).min(Duration::from_secs(10));
                    match self.answer(stream, id, io_limit) {
                        Ok(rank) => served[rank] = true,
                        Err(why) => last_refusal = why,
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => {
                    last_refusal = format!("accept failed: {e}");
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        Ok(())
    }

    /// Reads one peer's header and answers it; the served rank, or why it was refused.
    fn answer(&self, mut s: TcpStream, id: &[u8], limit: Duration) -> Result<usize, String> {
        let setup = s
            .set_nonblocking(false)
            .and_then(|()| s.set_read_timeout(Some(limit)))
            .and_then(|()| s.set_write_timeout(Some(limit)));
        setup.map_err(|e| format!("socket setup: {e}"))?;
        let mut hello = [0u8; 8 + 2 + 4 + 4 + 4];
        s.read_exact(&mut hello)
            .map_err(|e| format!("reading the peer's header: {e}"))?;
        let verdict = check_hello(&hello, self.world, id.len());
        let mut reply = Vec::with_capacity(8 + 2 + 1 + 4 + id.len());
        reply.extend_from_slice(MAGIC);
        reply.extend_from_slice(&VERSION.to_le_bytes());
        match &verdict {
            Ok(_) => {
                reply.push(0);
                reply.extend_from_slice(&(id.len() as u32).to_le_bytes());
                reply.extend_from_slice(id);
            }
            Err(why) => {
                reply.push(1);
                reply.extend_from_slice(&(why.len() as u32).to_le_bytes());
                reply.extend_from_slice(why.as_bytes());
            }
        }
        let sent = s.write_all(&reply).and_then(|()| s.flush());
        let rank = verdict?;
        sent.map_err(|e| format!("sending the id to rank {rank}: {e}"))?;
        Ok(rank)
    }
}

/// A peer's header: magic, version, rank, world size, id length (little-endian).
fn hello(rank: usize, world: usize, id_len: usize) -> Vec<u8> {
    let mut h = Vec::with_capacity(22);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    for v in [rank, world, id_len] {
        h.extend_from_slice(&u32::try_from(v).unwrap_or(u32::MAX).to_le_bytes());
    }
    h
}

fn u32_at(b: &[u8], at: usize) -> usize {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w) as usize
}

fn check_hello(h: &[u8; 22], world: usize, id_len: usize) -> Result<usize, String> {
    if &h[..8] != MAGIC {
        return Err(format!(
            "bad magic {:?} (not a cudnn-cbr rank)",
            String::from_utf8_lossy(&h[..8])
        ));
    }
    let version = u16::from_le_bytes([h[8], h[9]]);
    if version != VERSION {
        return Err(format!(
            "protocol version {version}, rank 0 speaks {VERSION}"
        ));
    }
    let (rank, their_world, their_len) = (u32_at(h, 10), u32_at(h, 14), u32_at(h, 18));
    if their_world != world {
        return Err(format!(
            "rank {rank} was launched with world size {their_world}, rank 0 with {world}"
        ));
    }
    if rank == 0 || rank >= world {
        return Err(format!(
            "rank {rank} is not a peer of rank 0 in a group of {world}"
        ));
    }
    if their_len != id_len {
        return Err(format!(
            "rank {rank} expects a {their_len}-byte id, rank 0 has {id_len} bytes"
        ));
    }
    Ok(rank)
}

/// A peer's side of the TCP store: connects to rank 0 at `addr` (retrying while it is not
/// up yet) and fetches the id.
///
/// # Errors
/// [`DistError::Store`]: rank 0 refused this peer (its reason), answered with a bad
/// header, or did not answer within `timeout`.
pub fn fetch_id<const N: usize>(
    addr: &str,
    rank: usize,
    world: usize,
    timeout: Duration,
) -> Result<[u8; N], DistError> {
    let deadline = Instant::now() + timeout;
    let mut last = String::from("no attempt");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(store_error(
                addr,
                format!("rank 0 did not hand out the id within {timeout:?} (last: {last})"),
            ));
        }
        match try_fetch::<N>(addr, rank, world, left) {
            Ok(id) => return Ok(id),
            Err(Fetch::Refused(why)) => return Err(store_error(addr, why)),
            Err(Fetch::Retry(why)) => {
                last = why;
                let pause = Duration::from_millis(50)
                    .min(deadline.saturating_duration_since(Instant::now()));
                std::thread::sleep(pause);
            }
        }
    }
}

/// Why one attempt to fetch failed.
enum Fetch {
    /// Not listening yet, or the connection broke: try again.
    Retry(String),
    /// Rank 0 (or something at its address) answered, and not with the id: give up.
    Refused(String),
}

fn try_fetch<const N: usize>(
    addr: &str,
    rank: usize,
    world: usize,
    left: Duration,
) -> Result<[u8; N], Fetch> {
    let targets: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| Fetch::Retry(format!("resolving: {e}")))?
        .collect();
    let mut stream = None;
    let mut last = String::from("the name resolves to no address");
    for t in &targets {
        match TcpStream::connect_timeout(t, left.min(Duration::from_secs(5))) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = format!("connecting to {t}: {e}"),
        }
    }
    let mut s = stream.ok_or(Fetch::Retry(last))?;
    let io = |e: std::io::Error| Fetch::Retry(format!("talking to rank 0: {e}"));
    s.set_read_timeout(Some(left)).map_err(io)?;
    s.set_write_timeout(Some(left)).map_err(io)?;
    s.write_all(&hello(rank, world, N)).map_err(io)?;
    let mut head = [0u8; 8 + 2 + 1 + 4];
    s.read_exact(&mut head).map_err(io)?;
    if &head[..8] != MAGIC {
        return Err(Fetch::Refused(format!(
            "the answer is not from a cudnn-cbr rank 0 (magic {:?})",
            String::from_utf8_lossy(&head[..8])
        )));
    }
    let version = u16::from_le_bytes([head[8], head[9]]);
    if version != VERSION {
        return Err(Fetch::Refused(format!(
            "rank 0 speaks protocol version {version}, this rank {VERSION}"
        )));
    }
    let len = u32_at(&head, 11);
    if len > MAX_ID {
        return Err(Fetch::Refused(format!("rank 0 announced {len} bytes")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(io)?;
    match head[10] {
        0 => body.try_into().map_err(|b: Vec<u8>| {
            Fetch::Refused(format!("rank 0 sent {} id bytes, expected {N}", b.len()))
        }),
        1 => Err(Fetch::Refused(format!(
            "rank 0 refused rank {rank}: {}",
            String::from_utf8_lossy(&body)
        ))),
        other => Err(Fetch::Refused(format!(
            "rank 0 answered with status {other}"
        ))),
    }
}

/// Writes the rendezvous file for a group of `world` ranks: the id with a header (magic,
/// version, world size, length), to a temporary file next to `path` renamed over it, so a
/// reader never sees half of it.
///
/// The file is not removed afterwards: use a fresh path per job (e.g. with
/// `$SLURM_JOB_ID` in it), or a later job's ranks may read this job's id.
///
/// # Errors
/// [`DistError::Store`] when the file cannot be written or renamed.
pub fn write_id_file(path: &Path, world: usize, id: &[u8]) -> Result<(), DistError> {
    let mut bytes = hello(0, world, id.len());
    bytes.extend_from_slice(id);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        store_error(path.display(), format!("rank 0 cannot write the id: {e}"))
    })
}

/// Waits (polling) for rank 0's rendezvous file at `path` and reads the id from it.
///
/// # Errors
/// [`DistError::Store`]: no file within `timeout`, a path that is not a regular file (a
/// FIFO, a folder), or one with a bad header, another world size or another id length.
pub fn read_id_file<const N: usize>(
    path: &Path,
    world: usize,
    timeout: Duration,
) -> Result<[u8; N], DistError> {
    let deadline = Instant::now() + timeout;
    // Only a regular file is read, and no more than a whole file's bytes: a FIFO at the path
    // would block a plain read for good, past the timeout.
    let read = || -> Result<Vec<u8>, String> {
        let file = cudnn_cbr_runtime::preflight::open_regular(path)?;
        let mut b = Vec::new();
        file.take(22 + N as u64 + 1)
            .read_to_end(&mut b)
            .map_err(|e| format!("cannot read: {e}"))?;
        Ok(b)
    };
    let bytes = loop {
        match std::fs::metadata(path) {
            Ok(_) => break read().map_err(|why| store_error(path.display(), why))?,
            Err(e) if Instant::now() >= deadline => {
                return Err(store_error(
                    path.display(),
                    format!("rank 0 did not write the id within {timeout:?} ({e})"),
                ))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    let bad = |why: String| store_error(path.display(), why);
    let head: &[u8; 22] = bytes
        .get(..22)
        .and_then(|h| h.try_into().ok())
        .ok_or_else(|| bad(format!("{} bytes: too short for the header", bytes.len())))?;
    if &head[..8] != MAGIC {
        return Err(bad("not a rendezvous file of cudnn-cbr (bad magic)".into()));
    }
    let version = u16::from_le_bytes([head[8], head[9]]);
    if version != VERSION {
        return Err(bad(format!(
            "format version {version}, this rank reads {VERSION}"
        )));
    }
    let (their_world, len) = (u32_at(head, 14), u32_at(head, 18));
    if their_world != world {
        return Err(bad(format!(
            "written for world size {their_world}, this rank has {world} (a stale file?)"
        )));
    }
    if len != N || bytes.len() != 22 + N {
        return Err(bad(format!(
            "holds a {len}-byte id in {} bytes, expected {N} bytes",
            bytes.len()
        )));
    }
    let mut id = [0u8; N];
    id.copy_from_slice(&bytes[22..]);
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn headers_are_checked_field_by_field() {
        let good: [u8; 22] = hello(3, 4, 128).try_into().unwrap();
        assert_eq!(check_hello(&good, 4, 128), Ok(3));
        assert!(check_hello(&good, 8, 128)
            .unwrap_err()
            .contains("world size 4"));
        assert!(check_hello(&good, 4, 64).unwrap_err().contains("128-byte"));
        let zero: [u8; 22] = hello(0, 4, 128).try_into().unwrap();
        assert!(check_hello(&zero, 4, 128)
            .unwrap_err()
            .contains("not a peer"));
        let mut v2 = good;
        v2[8] = 2;
        assert!(check_hello(&v2, 4, 128).unwrap_err().contains("version 2"));
        let mut magic = good;
        magic[0] = b'X';
        assert!(check_hello(&magic, 4, 128)
            .unwrap_err()
            .contains("bad magic"));
    }
    #[test]
    fn a_store_for_no_ranks_is_refused_and_one_for_one_rank_is_done_at_once() {
        assert_eq!(
            IdServer::bind("127.0.0.1:0", 0).unwrap_err(),
            DistError::EmptyGroup
        );
        let alone = IdServer::bind("127.0.0.1:0", 1).unwrap();
        assert_eq!(alone.serve(&[1, 2, 3], Duration::ZERO), Ok(()));
    }
}
