//! Headless Chromium, for the tests that look at what a real browser does with the fleet's pages and files: one run
//! that dumps a page ([`run`]), or a browser driven over the DevTools protocol ([`Browser`]).

use std::path::Path;
use std::time::Duration;

/// Failure guard of one run: Chromium is killed after it.
const GUARD: Duration = Duration::from_secs(90);

/// Headless, quiet, nothing fetched on its own, no sandbox of its own (the tests may run as root).
const FLAGS: [&str; 9] = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
];

/// `chromium`, or a failure saying how to get it.
///
/// # Panics
/// If neither `chromium` nor `chromium-browser` runs.
pub fn binary() -> String {
    for bin in ["chromium", "chromium-browser"] {
        if std::process::Command::new(bin)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return bin.to_owned();
        }
    }
    panic!(
        "this test needs headless Chromium: `apt-get install -y chromium` (scripts/test.sh installs it when run as \
         root)"
    );
}

/// Runs headless Chromium on `url` with `extra` flags (e.g. `--dump-dom`), its profile in `profile`; returns its
/// stdout. Not for a link that may be a download (headless Chromium then may not exit): see [`Browser`].
///
/// # Panics
/// If Chromium does not start, fails, or is still running after the failure guard.
pub async fn run(url: &str, profile: &Path, extra: &[&str]) -> String {
    let mut cmd = tokio::process::Command::new(binary());
    cmd.args(FLAGS)
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .kill_on_drop(true)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let out = tokio::time::timeout(GUARD, cmd.output())
        .await
        .unwrap_or_else(|_| panic!("failure guard: chromium still running after {GUARD:?}"))
        .unwrap_or_else(|e| panic!("chromium did not run: {e}"));
    assert!(out.status.success(), "chromium failed: {:?}", out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What the browser made of one navigation ([`Browser::visit`]).
#[derive(Debug, Clone)]
pub struct Visit {
    /// Chromium took the response as a download (`Content-Disposition: attachment`): nothing was rendered.
    pub download: bool,
    /// The navigation's error (`net::ERR_ABORTED` for a download), if any.
    pub error: Option<String>,
    /// `document.title` of the tab afterwards (a fresh tab per visit: empty when nothing was rendered).
    pub title: String,
    /// `document.documentElement.outerHTML` afterwards.
    pub html: String,
}

/// A headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: messages are JSON
/// ended by a NUL byte, fd 3 towards the browser, fd 4 from it), so a test reads a navigation's outcome from the
/// browser itself: whether it became a download, and the document it left. Downloads are denied (nothing is
/// written anywhere). Every wait has the failure guard.
#[derive(Debug)]
pub struct Browser {
    child: tokio::process::Child,
    to: tokio::process::ChildStdin,
    from: tokio::io::BufReader<tokio::process::ChildStdout>,
    next_id: u64,
}

impl Browser {
    /// Starts Chromium with its profile in `profile`.
    ///
    /// # Panics
    /// If Chromium does not start or does not answer.
    pub async fn launch(profile: &Path) -> Browser {
        // The shell only moves its stdin and stdout to the protocol's fds 3 and 4, then becomes Chromium.
        let mut child = tokio::process::Command::new("sh")
            .arg("-c")
            .arg("exec \"$0\" \"$@\" 3<&0 4>&1 </dev/null >/dev/null")
            .arg(binary())
            .args(FLAGS)
            .arg("--remote-debugging-pipe")
            .arg(format!("--user-data-dir={}", profile.display()))
            .kill_on_drop(true)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("chromium did not start: {e}"));
        let to = child.stdin.take().expect("piped stdin");
        let from = tokio::io::BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut browser = Browser {
            child,
            to,
            from,
            next_id: 0,
        };
        browser
            .call(
                "Browser.setDownloadBehavior",
                serde_json::json!({"behavior": "deny", "eventsEnabled": true}),
                None,
                &mut Vec::new(),
            )
            .await;
        browser
    }

    /// Opens `url` in a tab of its own and reads what it left: a download, or the rendered document once its
    /// `load` event fired.
    ///
    /// # Panics
    /// If the browser stops answering, or the page never loads, within the failure guard.
    pub async fn visit(&mut self, url: &str) -> Visit {
        tokio::time::timeout(GUARD, self.visit_unguarded(url))
            .await
            .unwrap_or_else(|_| panic!("failure guard: chromium did not finish visiting {url} in {GUARD:?}"))
    }

    async fn visit_unguarded(&mut self, url: &str) -> Visit {
        let mut events = Vec::new();
        let target = self
            .call(
                "Target.createTarget",
                serde_json::json!({"url": "about:blank"}),
                None,
                &mut events,
            )
            .await["targetId"]
            .clone();
        let attached = self
            .call(
                "Target.attachToTarget",
                serde_json::json!({"targetId": target, "flatten": true}),
                None,
                &mut events,
            )
            .await;
        let session = attached["sessionId"].as_str().expect("sessionId").to_owned();
        let s = Some(session.as_str());
        self.call("Page.enable", serde_json::json!({}), s, &mut events)
            .await;
        events.clear();
        let nav = self
            .call("Page.navigate", serde_json::json!({"url": url}), s, &mut events)
            .await;
        let download = nav["isDownload"].as_bool().unwrap_or(false);
        let error = nav["errorText"].as_str().map(str::to_owned);
        if error.is_none() {
            let loaded = |e: &serde_json::Value| {
                e["method"] == "Page.loadEventFired" && e["sessionId"].as_str() == Some(session.as_str())
            };
            while !events.iter().any(loaded) {
                events.push(self.read().await);
            }
        }
        let expression = "JSON.stringify([document.title, document.documentElement.outerHTML])";
        let evaluated = self
            .call(
                "Runtime.evaluate",
                serde_json::json!({"expression": expression, "returnByValue": true}),
                s,
                &mut events,
            )
            .await;
        let (title, html): (String, String) =
            serde_json::from_str(evaluated["result"]["value"].as_str().unwrap_or("[\"\",\"\"]"))
                .expect("title and HTML");
        self.call(
            "Target.closeTarget",
            serde_json::json!({"targetId": target}),
            None,
            &mut events,
        )
        .await;
        Visit {
            download,
            error,
            title,
            html,
        }
    }

    /// Sends one command and reads until its answer; the events read meanwhile go to `events`. Its `result`.
    async fn call(
        &mut self,
        method: &str,
        params: serde_json::Value,
        session: Option<&str>,
        events: &mut Vec<serde_json::Value>,
    ) -> serde_json::Value {
        let id = self.send(method, params, session).await;
        loop {
            let m = self.read().await;
            if m["id"] == id {
                assert!(m.get("error").is_none(), "chromium refused {method}: {m}");
                return m["result"].clone();
            }
            events.push(m);
        }
    }

    /// Sends one command: its id.
    async fn send(&mut self, method: &str, params: serde_json::Value, session: Option<&str>) -> u64 {
        use tokio::io::AsyncWriteExt as _;
        self.next_id += 1;
        let id = self.next_id;
        let mut message = serde_json::json!({"id": id, "method": method, "params": params});
        if let Some(s) = session {
            message["sessionId"] = serde_json::Value::from(s);
        }
        let mut bytes = serde_json::to_vec(&message).expect("a JSON message");
        bytes.push(0);
        self.to.write_all(&bytes).await.expect("write to chromium");
        self.to.flush().await.expect("flush to chromium");
        id
    }

    /// The next message from the browser.
    async fn read(&mut self) -> serde_json::Value {
        use tokio::io::AsyncBufReadExt as _;
        let mut buf = Vec::new();
        let n = self
            .from
            .read_until(0, &mut buf)
            .await
            .expect("read from chromium");
        assert!(
            n > 0 && buf.last() == Some(&0),
            "chromium closed its protocol pipe"
        );
        buf.pop();
        serde_json::from_slice(&buf).expect("a JSON message from chromium")
    }

    /// Closes the browser and waits for it to exit.
    ///
    /// # Panics
    /// If it does not exit within the failure guard.
    pub async fn close(mut self) {
        self.send("Browser.close", serde_json::json!({}), None).await;
        tokio::time::timeout(GUARD, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("failure guard: chromium still running {GUARD:?} after Browser.close"))
            .expect("chromium exit status");
    }
}
