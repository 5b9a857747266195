//! The network namespace of an egress-granted plugin, made by the worker before the spawn so that the egress
//! proxy's listener is already inside it when the plugin starts (`crate::egress` serves it).
//!
//! A dedicated short-lived thread unshares its own network namespace (`unshare(CLONE_NEWNET)` affects only the
//! calling thread), brings its `lo` up, binds the listener on `127.0.0.1:<port>` there and opens
//! `/proc/thread-self/ns/net`; then it exits. The namespace lives on through those two file descriptors: the
//! plugin joins it with `setns` in its spawn hook instead of unsharing a new one, and a restarted process of the
//! same session joins the same one. When the session's plan (and so [`EgressNet`]) is dropped, the proxy stops
//! and the namespace goes with its last process.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::{AsRawFd as _, OwnedFd};

use rustix::fs::{CWD, Mode, OFlags};
use rustix::thread::UnshareFlags;

/// A prepared network namespace and the proxy serving inside it.
#[derive(Debug)]
pub(crate) struct EgressNet {
    /// `/proc/thread-self/ns/net` of the namespace, for `setns`.
    pub(crate) ns: OwnedFd,
    /// The proxy's accept loop (aborted on drop, which ends its connections too).
    proxy: tokio::task::AbortHandle,
}

impl Drop for EgressNet {
    fn drop(&mut self) {
        self.proxy.abort();
    }
}

impl EgressNet {
    /// A new namespace whose `127.0.0.1:port` is served by `serve` (given the listener) on the current tokio
    /// runtime. Fails without a runtime, or without `CAP_SYS_ADMIN` / `CAP_NET_ADMIN`.
    pub(crate) fn create<F, Fut>(port: u16, serve: F) -> io::Result<EgressNet>
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
        Ok(EgressNet { ns, proxy })
    }
}

/// Runs on its own thread, which exits right after: the thread's new namespace, `lo` up, the listener, the
/// namespace's fd.
#[allow(unsafe_code)]
fn in_new_namespace(port: u16) -> io::Result<(OwnedFd, std::net::TcpListener)> {
    // SAFETY: `unshare` without `CLONE_FILES` (or `CLONE_FS`) changes nothing another thread can observe: the
    // network namespace is per thread, and this thread exits as soon as this function returns.
    unsafe { rustix::thread::unshare_unsafe(UnshareFlags::NEWNET)? };
    loopback_up()?;
    let listener = std::net::TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))?;
    let ns = rustix::fs::openat(
        CWD,
        c"/proc/thread-self/ns/net",
        OFlags::RDONLY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    Ok((ns, listener))
}

/// `IFF_UP` as the `short` `ifreq` carries it (libc declares it `c_int`).
const IFF_UP: libc::c_short = 0x1;

/// Brings `lo` up in the calling thread's network namespace (`SIOCGIFFLAGS`, `| IFF_UP`, `SIOCSIFFLAGS`): a
/// child's new one (`spawn.rs`), or one made here for an egress proxy. Allocation-free.
#[allow(unsafe_code)]
pub(super) fn loopback_up() -> io::Result<()> {
    let sock = rustix::net::socket(
        rustix::net::AddressFamily::INET,
        rustix::net::SocketType::DGRAM,
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
