//! The mission's first scenario, in a real browser: a person double-clicks "Sign up". Headless
//! Chromium (Debian's `chromium`, driven over WebDriver through `chromedriver`) submits the
//! example's HTML form (`examples/shared/signup.rs`, no JavaScript) to two instances of the
//! service sharing one Redis: a real double-click on the submit button, the same form sent from
//! two tabs to the two instances at once, and the back button followed by a resubmission. Each
//! ends on the account's page with exactly one account. The result page is saved as
//! `docs/signup.png` for the README.
//!
//! Needs `chromium` and `chromedriver` on `PATH` (`scripts/test.sh` installs Debian's
//! `chromium` and `chromium-driver` when they are missing); fails, with that advice, without.

mod support;

#[path = "../examples/shared/signup.rs"]
#[allow(dead_code)]
mod signup_app;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use fantoccini::actions::{InputSource, MOUSE_BUTTON_LEFT, MouseActions, PointerAction};
use fantoccini::{Client, ClientBuilder, Locator};
use support::{DEADLINE, send, within};

/// Simulated latency of the insert: the window in which a second click races the first.
const WORK: Duration = Duration::from_secs(1);

fn on_path(binary: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(binary))
        .find(|p| p.is_file())
}

fn required(binary: &str, package: &str) -> std::path::PathBuf {
    on_path(binary).unwrap_or_else(|| {
        panic!(
            "the browser test needs {binary} on PATH: apt-get install -y {package} \
             (scripts/test.sh installs it)"
        )
    })
}

/// A `chromedriver` process on a free loopback port, killed (by pid) on drop.
struct Driver {
    child: Child,
    port: u16,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    async fn start() -> Self {
        let binary = required("chromedriver", "chromium-driver");
        let port = testkit::free_port().unwrap();
        let child = Command::new(&binary)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", binary.display()));
        let mut driver = Driver { child, port };
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            if let Ok(Some(status)) = driver.child.try_wait() {
                panic!("chromedriver exited at start: {status}");
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return driver;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "chromedriver did not listen on port {port} within {DEADLINE:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A headless Chromium session with a fresh profile, pages loaded without waiting (the
    /// test waits for what it needs, with deadlines).
    async fn browser(&self, profile: &std::path::Path) -> Client {
        let chromium = required("chromium", "chromium");
        let mut caps = serde_json::Map::new();
        caps.insert("pageLoadStrategy".into(), "none".into());
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": chromium,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync",
                    "--window-size=800,600",
                    format!("--user-data-dir={}", profile.display()),
                ],
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        within(
            "a Chromium session",
            ClientBuilder::new(connector)
                .capabilities(caps)
                .connect(&format!("http://127.0.0.1:{}", self.port)),
        )
        .await
        .unwrap_or_else(|e| panic!("chromedriver would not start Chromium: {e}"))
    }
}

/// Waits until the current page's path is `path` (or, with `None`, an account page) and its
/// `#ready` element is there; returns the path.
async fn wait_for_page(browser: &Client, what: &str, path: Option<&str>) -> String {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Ok(url) = browser.current_url().await {
            let here = url.path().to_owned();
            let arrived = match path {
                Some(path) => here == path,
                None => here.starts_with("/accounts/"),
            };
            let selector = if here.starts_with("/accounts/") {
                "#count"
            } else {
                "#submit"
            };
            if arrived && browser.find(Locator::Css(selector)).await.is_ok() {
                return here;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {DEADLINE:?} for {what}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn text(browser: &Client, css: &str) -> String {
    browser
        .find(Locator::Css(css))
        .await
        .unwrap_or_else(|e| panic!("no {css} on the page: {e}"))
        .text()
        .await
        .unwrap()
}

async fn fill(browser: &Client, name: &str, phone: &str) {
    for (field, value) in [("#name", name), ("#phone", phone)] {
        let input = browser.find(Locator::Css(field)).await.unwrap();
        input.clear().await.unwrap();
        input.send_keys(value).await.unwrap();
    }
}

/// One click on the form's button (returns at once: pages load without waiting).
async fn click_submit(browser: &Client) {
    browser
        .find(Locator::Css("#submit"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

async fn form_key(browser: &Client) -> String {
    browser
        .find(Locator::Css("input[name=idempotency_key]"))
        .await
        .unwrap()
        .prop("value")
        .await
        .unwrap()
        .expect("the form carries its key")
}

/// One instance of the service over HTTP, counting the form posts it receives (outside the
/// layer: every submission the browser sent).
async fn instance(
    url: &str,
    prefix: &str,
    users: signup_app::Users,
    posts: Arc<AtomicUsize>,
) -> std::net::SocketAddr {
    let store = support::redis_store(url, prefix).await;
    let app = signup_app::app(store, support::SECRET, users)
        .unwrap()
        .layer(axum::middleware::from_fn(
            move |request: Request<Body>, next: axum::middleware::Next| {
                let posts = posts.clone();
                async move {
                    if request.method() == "POST" && request.uri().path() == "/signup/form" {
                        posts.fetch_add(1, Ordering::SeqCst);
                    }
                    next.run(request).await
                }
            },
        ));
    support::serve(app).await.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_double_click_two_tabs_and_a_resubmission_each_create_one_account() {
    let server = testkit::RedisServer::start().await;
    let prefix = testkit::unique_prefix("browser");
    let users = signup_app::Users::with_work(WORK);
    let posts = Arc::new(AtomicUsize::new(0));
    let a = instance(&server.url(), &prefix, users.clone(), posts.clone()).await;
    let b = instance(&server.url(), &prefix, users.clone(), posts.clone()).await;

    let driver = Driver::start().await;
    let profile = tempfile::tempdir().unwrap();
    let browser = driver.browser(profile.path()).await;

    // 1. A real double-click on the submit button: two clicks, two submissions of one form.
    browser.goto(&format!("http://{a}/")).await.unwrap();
    wait_for_page(&browser, "the form", Some("/")).await;
    fill(&browser, "Ada Lovelace", "+15550100").await;
    let submit = browser.find(Locator::Css("#submit")).await.unwrap();
    // A person's double-click: two clicks on the button's centre, the second 250 ms after the
    // first (inside the usual 500 ms double-click interval), in one action sequence: the
    // browser sends the first submission, then the second, which cancels the first navigation
    // (its request has left: the service runs it). Two clicks in the very same instant would be
    // one submission (the browser replaces a navigation it has not started yet); and a click
    // sent as a separate WebDriver command would wait for the first navigation to end.
    let (left, top, width, height) = submit.rectangle().await.unwrap();
    let at = PointerAction::MoveTo {
        duration: None,
        x: left + width / 2.0,
        y: top + height / 2.0,
    };
    let down = || PointerAction::Down {
        button: MOUSE_BUTTON_LEFT,
    };
    let up = || PointerAction::Up {
        button: MOUSE_BUTTON_LEFT,
    };
    let double_click = MouseActions::new("mouse".into())
        .then(at)
        .then(down())
        .then(up())
        .pause(Duration::from_millis(250))
        .then(down())
        .then(up());
    browser.perform_actions(double_click).await.unwrap();
    let result = wait_for_page(&browser, "the account page after a double-click", None).await;
    assert_eq!(
        text(&browser, "#count").await,
        "1",
        "the page says one account"
    );
    assert_eq!(text(&browser, "#phone").await, "+15550100");
    let after_double_click = posts.load(Ordering::SeqCst);
    assert_eq!(
        after_double_click, 2,
        "the double-click sent the form twice (else this proves nothing)"
    );
    let screenshot = browser.screenshot().await.unwrap();
    std::fs::write(
        concat!(env!("CARGO_MANIFEST_DIR"), "/docs/signup.png"),
        screenshot,
    )
    .unwrap();

    // 2. The back button, then the same form submitted again: the first redirect, replayed.
    browser.back().await.unwrap();
    wait_for_page(&browser, "the form after going back", Some("/")).await;
    fill(&browser, "Ada Lovelace", "+15550100").await;
    click_submit(&browser).await;
    let again = wait_for_page(&browser, "the account page after resubmitting", None).await;
    assert_eq!(again, result, "the resubmission landed on the same account");
    assert_eq!(text(&browser, "#count").await, "1");
    assert_eq!(posts.load(Ordering::SeqCst), after_double_click + 1);

    // 3. One form in two tabs (a duplicated tab), each sent to another instance, at once.
    browser.goto(&format!("http://{a}/")).await.unwrap();
    wait_for_page(&browser, "the form in the first tab", Some("/")).await;
    fill(&browser, "Grace Hopper", "+15550199").await;
    let key = form_key(&browser).await;
    let first_tab = browser.window().await.unwrap();
    let second_tab = browser.new_window(true).await.unwrap().handle;
    browser.switch_to_window(second_tab.clone()).await.unwrap();
    browser.goto(&format!("http://{b}/")).await.unwrap();
    wait_for_page(&browser, "the form in the second tab", Some("/")).await;
    // The duplicated tab shows the same render of the form: the same hidden key.
    browser
        .execute(
            "document.querySelector('input[name=idempotency_key]').value = arguments[0]",
            vec![key.clone().into()],
        )
        .await
        .unwrap();
    assert_eq!(form_key(&browser).await, key);
    fill(&browser, "Grace Hopper", "+15550199").await;
    let before_tabs = posts.load(Ordering::SeqCst);
    // Both submissions are in flight together: clicks return at once (no page-load wait).
    click_submit(&browser).await;
    browser.switch_to_window(first_tab.clone()).await.unwrap();
    click_submit(&browser).await;
    let in_first = wait_for_page(&browser, "the account page in the first tab", None).await;
    browser.switch_to_window(second_tab).await.unwrap();
    let in_second = wait_for_page(&browser, "the account page in the second tab", None).await;
    assert_eq!(in_first, in_second, "both tabs show the one account");
    assert_eq!(text(&browser, "#count").await, "1");
    assert_eq!(posts.load(Ordering::SeqCst), before_tabs + 2);

    browser.close().await.unwrap();
    let counts = users.count_by_phone().await;
    assert_eq!(counts.get("+15550100"), Some(&1), "{counts:?}");
    assert_eq!(counts.get("+15550199"), Some(&1), "{counts:?}");
    assert_eq!(users.rows().await.len(), 2, "{:?}", users.rows().await);
}

/// The form over plain HTTP: each render has its own key; the post answers 303 to the account;
/// the same post again replays the redirect; the JSON API keyed by phone number still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_form_posts_redirect_and_replay_without_a_browser() {
    let s = support::TestStore::memory().await;
    let users = signup_app::Users::with_work(Duration::from_millis(10));
    let app = signup_app::app(s.store.clone(), support::SECRET, users.clone()).unwrap();
    let page = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert_eq!(page.status, StatusCode::OK);
    let html = String::from_utf8(page.body.to_vec()).unwrap();
    let key = html
        .split("name=\"idempotency_key\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .expect("a hidden key")
        .to_owned();
    assert_eq!(key.len(), 32);
    let other = send(&app, Request::get("/").body(Body::empty()).unwrap()).await;
    assert!(
        !String::from_utf8_lossy(&other.body).contains(&key),
        "each render has its own key"
    );
    let post = || {
        Request::post("/signup/form")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(Body::from(format!(
                "idempotency_key={key}&name=Ada&phone=%2B15550100"
            )))
            .unwrap()
    };
    let first = send(&app, post()).await;
    assert_eq!(first.status, StatusCode::SEE_OTHER);
    let location = first.headers["location"].clone();
    let second = send(&app, post()).await;
    assert_eq!(second.status, StatusCode::SEE_OTHER);
    assert!(second.replayed());
    assert_eq!(second.headers["location"], location);
    let result = send(
        &app,
        Request::get(location.to_str().unwrap())
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert!(String::from_utf8_lossy(&result.body).contains(r#"id="count">1<"#));
    assert_eq!(users.rows().await.len(), 1);

    let json = send(
        &app,
        Request::post("/signup")
            .header("content-type", "application/json")
            .body(Body::from(r#"{"phone":"+15550111","name":"Grace"}"#))
            .unwrap(),
    )
    .await;
    assert_eq!(json.status, StatusCode::CREATED);
    assert_eq!(users.rows().await.len(), 2);
}
