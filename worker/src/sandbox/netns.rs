//! Network namespaces the worker makes before a spawn, for the plugin to join (`setns`) instead of unsharing a
//! new one in its spawn hook:
//!
//! - an egress-granted plugin's ([`NetNs::egress`]): the egress proxy's listener is already inside it when the
//!   plugin starts (`crate::egress` serves it). A dedicated short-lived thread unshares its own network
//!   namespace (`unshare(CLONE_NEWNET)` affects only the calling thread), brings its `lo` up, binds the listener
//!   on `127.0.0.1:<port>` there and opens `/proc/thread-self/ns/net`; then it exits;
//! - every other confined plugin's, from a small pool ([`NetnsPool`]) that one background thread keeps filled:
//!   making a network namespace is the largest single cost of confining a spawn (~0.7 ms here), and the pool
//!   takes it off a session's cold start. A pooled namespace is empty (only `lo`, up) and handed to exactly
//!   one session: nothing returns to the pool.
//!
//! A namespace lives on through its file descriptor: a restarted process of the same session joins the same
//! one. When the session's plan (and so its [`NetNs`]) is dropped, an egress proxy stops and the namespace goes
//! with its last process.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd as _, OwnedFd};
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use rustix::fs::{CWD, Mode, OFlags};
use rustix::thread::UnshareFlags;

/// A prepared network namespace (and, for egress, the proxy serving inside it).
#[derive(Debug)]
pub(crate) struct NetNs {
    /// `/proc/thread-self/ns/net` of the namespace, for `setns`.
    pub(crate) ns: OwnedFd,
    /// The egress proxy's accept loop (aborted on drop, which ends its connections too).
    proxy: Option<tokio::task::AbortHandle>,
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if let Some(proxy) = &self.proxy {
            proxy.abort();
        }
    }
}

impl NetNs {
    /// A new namespace whose `127.0.0.1:port` is served by `serve` (given the listener) on the current tokio
    /// runtime. Fails without a runtime, or without `CAP_SYS_ADMIN` / `CAP_NET_ADMIN`.
    pub(crate) fn egress<F, Fut>(port: u16, serve: F) -> io::Result<NetNs>
    where
        F: FnOnce(tokio::net::TcpListener) -> Fut,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|_| io::Error::other("egress needs the worker's tokio runtime"))?;
        let (ns, listener) = std::thread::Builder::new()
            .name("egress-netns".into())
            .spawn(move || in_new_namespace(port))
            .map_err(io::Error::other)?
            .join()
            .map_err(|_| io::Error::other("the namespace thread panicked"))??;
        listener.set_nonblocking(true)?;
        let listener = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(listener)?
        };
        let proxy = runtime.spawn(serve(listener)).abort_handle();
        Ok(NetNs {
            ns,
            proxy: Some(proxy),
        })
    }
}

/// Empty network namespaces made ahead of need by one background thread, at most `target` waiting.
#[derive(Debug)]
pub(crate) struct NetnsPool {
    shared: Arc<(Mutex<PoolState>, Condvar)>,
}

#[derive(Debug)]
struct PoolState {
    ready: Vec<OwnedFd>,
    target: usize,
    closed: bool,
    /// Why the last refill failed (the pool then stops refilling: a spawn unshares as without it).
    failed: Option<io::ErrorKind>,
}

impl NetnsPool {
    /// A pool keeping `target` namespaces ready (0: none, no thread).
    pub(crate) fn new(target: usize) -> io::Result<NetnsPool> {
        let shared = Arc::new((
            Mutex::new(PoolState {
                ready: Vec::with_capacity(target),
                target,
                closed: target == 0,
                failed: None,
            }),
            Condvar::new(),
        ));
        if target > 0 {
            let refill = shared.clone();
            std::thread::Builder::new()
                .name("netns-pool".into())
                .spawn(move || refill_loop(&refill))?;
        }
        Ok(NetnsPool { shared })
    }

    /// A ready namespace, if one is waiting (the refill thread is woken to replace it).
    pub(crate) fn take(&self) -> Option<NetNs> {
        let (lock, wake) = &*self.shared;
        let ns = lock.lock().unwrap_or_else(PoisonError::into_inner).ready.pop()?;
        wake.notify_one();
        Some(NetNs { ns, proxy: None })
    }

    /// How many are waiting.
    pub(crate) fn ready(&self) -> usize {
        self.shared
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .ready
            .len()
    }
}

impl Drop for NetnsPool {
    fn drop(&mut self) {
        let (lock, wake) = &*self.shared;
        lock.lock().unwrap_or_else(PoisonError::into_inner).closed = true;
        wake.notify_all();
    }
}

/// The pool thread: makes a namespace whenever fewer than `target` wait. Each `unshare` moves this thread into
/// the namespace it made (the previous one lives on through its fd); the thread never uses the network.
fn refill_loop(shared: &(Mutex<PoolState>, Condvar)) {
    let (lock, wake) = shared;
    loop {
        {
            let mut state = lock.lock().unwrap_or_else(PoisonError::into_inner);
            while !state.closed && state.ready.len() >= state.target {
                state = wake.wait(state).unwrap_or_else(PoisonError::into_inner);
            }
            if state.closed || state.failed.is_some() {
                return;
            }
        }
        let made = this_thread_into_new_namespace();
        let mut state = lock.lock().unwrap_or_else(PoisonError::into_inner);
        match made {
            Ok(ns) if !state.closed => state.ready.push(ns),
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(error = %e, "cannot pre-create network namespaces: each spawn makes its own");
                state.failed = Some(e.kind());
                return;
            }
        }
    }
}

/// Runs on its own thread, which exits right after: the thread's new namespace, `lo` up, the listener, the
/// namespace's fd.
fn in_new_namespace(port: u16) -> io::Result<(OwnedFd, std::net::TcpListener)> {
    let ns = this_thread_into_new_namespace()?;
    let listener = std::net::TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))?;
    Ok((ns, listener))
}

/// Moves the calling thread into a new network namespace with `lo` up and returns the namespace's fd. Only for
/// threads of this module (a short-lived one, the pool's): a tokio worker thread must never change namespace.
#[allow(unsafe_code)]
fn this_thread_into_new_namespace() -> io::Result<OwnedFd> {
    // SAFETY: `unshare` without `CLONE_FILES` (or `CLONE_FS`) changes nothing another thread can observe: the
    // network namespace is per thread, and the calling thread is one of this module's own.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWNET)? };
    loopback_up()?;
    Ok(rustix::fs::openat(
        CWD,
        c"/proc/thread-self/ns/net",
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// `IFF_UP` as the `short` `ifreq` carries it (libc declares it `c_int`).
const IFF_UP: libc::c_short = 0x1;

/// Brings `lo` up in the calling thread's network namespace (`SIOCGIFFLAGS`, `| IFF_UP`, `SIOCSIFFLAGS`): a
/// child's new one (`spawn.rs`), or one made here for an egress proxy. Allocation-free. The socket is
/// close-on-exec: this runs on the pool's and the egress threads while other threads fork plugins, and a plugin
/// must not inherit a socket of another session's namespace.
#[allow(unsafe_code)]
pub(super) fn loopback_up() -> io::Result<()> {
    let sock = rustix::net::socket_with(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::DGRAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )?;
    // SAFETY: `ifreq` is plain old data, valid when zeroed.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: both ioctls take a pointer to an `ifreq` that outlives the call; the fd is open.
    unsafe {
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) < 0 {
            return Err(io::Error::last_os_error());
        }
        // IFF_UP is 1: it fits the kernel's short flags.
        req.ifr_ifru.ifru_flags |= IFF_UP;
        if libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}
