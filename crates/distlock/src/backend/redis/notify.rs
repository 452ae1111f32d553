//! One shared pub/sub connection per client, carrying the release announcements of every lock
//! some local task is waiting for.
//!
//! The task subscribes a channel when its first local waiter arrives and unsubscribes it when the
//! last one leaves. If the connection breaks it reconnects with backoff, subscribes again to every
//! channel still waited on, and wakes all waiters once, because releases during the outage were
//! missed. Waiters never depend on it alone: they poll with backoff as well.

use std::sync::{Arc, Weak};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::mpsc;

use crate::Backoff;
use crate::backend::waiters::{Command, Waiters};

/// Starts the pub/sub task for `client` and returns the registry that feeds it. The task ends
/// when the registry is dropped.
pub(crate) fn spawn_notifier(client: redis::Client, op_timeout: Duration) -> Arc<Waiters> {
    let (tx, rx) = mpsc::unbounded_channel();
    let waiters = Waiters::with_feed(tx);
    tokio::spawn(run(client, Arc::downgrade(&waiters), rx, op_timeout));
    waiters
}

async fn run(
    client: redis::Client,
    waiters: Weak<Waiters>,
    mut commands: mpsc::UnboundedReceiver<Command>,
    op_timeout: Duration,
) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        let connected = tokio::time::timeout(op_timeout, client.get_async_pubsub()).await;
        let pubsub = match connected {
            Ok(Ok(pubsub)) => pubsub,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "lock notifications: connect failed, waiters poll");
                if !idle(&mut commands, backoff.next_delay()).await {
                    return;
                }
                continue;
            }
            Err(_) => {
                tracing::debug!("lock notifications: connect timed out, waiters poll");
                if !idle(&mut commands, backoff.next_delay()).await {
                    return;
                }
                continue;
            }
        };
        let (mut sink, mut stream) = pubsub.split();
        let Some(registry) = waiters.upgrade() else {
            return;
        };
        let channels = registry.channels();
        if !channels.is_empty()
            && !matches!(
                tokio::time::timeout(op_timeout, sink.subscribe(&channels)).await,
                Ok(Ok(()))
            )
        {
            continue;
        }
        // Releases announced while we were not subscribed were missed: let everyone look again.
        registry.wake_all();
        drop(registry);
        backoff.reset();

        loop {
            tokio::select! {
                command = commands.recv() => match command {
                    None => return,
                    Some(Command::Subscribe(channel, ack)) => {
                        match tokio::time::timeout(op_timeout, sink.subscribe(&channel)).await {
                            Ok(Ok(())) => {
                                let _ = ack.send(());
                            }
                            _ => break,
                        }
                    }
                    Some(Command::Unsubscribe(channel)) => {
                        let Some(registry) = waiters.upgrade() else { return };
                        if !registry.is_waited(&channel) {
                            drop(registry);
                            if !matches!(
                                tokio::time::timeout(op_timeout, sink.unsubscribe(&channel)).await,
                                Ok(Ok(()))
                            ) {
                                break;
                            }
                        }
                    }
                },
                message = stream.next() => match message {
                    None => break,
                    Some(message) => {
                        let Some(registry) = waiters.upgrade() else { return };
                        registry.wake(message.get_channel_name());
                    }
                },
            }
        }
        tracing::debug!("lock notifications: connection lost, reconnecting");
    }
}

/// Waits `delay` while answering commands (subscriptions cannot be made now: the waiters poll).
/// Returns false when the client is gone.
async fn idle(commands: &mut mpsc::UnboundedReceiver<Command>, delay: Duration) -> bool {
    let sleep = tokio::time::sleep(delay);
    tokio::pin!(sleep);
    loop {
        tokio::select! {
            _ = &mut sleep => return true,
            command = commands.recv() => match command {
                // Dropping the acknowledgement tells the waiter to rely on polling.
                Some(_) => {}
                None => return false,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Publishes an announcement; returns how many subscribers received it.
    async fn publish(server: &testkit::RedisServer, channel: &str) -> i64 {
        let mut conn = server.connection().await;
        redis::cmd("PUBLISH")
            .arg(channel)
            .arg("")
            .query_async(&mut conn)
            .await
            .unwrap()
    }

    /// The release announcement wakes a waiter over the shared connection, and after the server
    /// restarts the task resubscribes by itself.
    #[tokio::test]
    async fn announcements_wake_waiters_and_survive_a_restart() {
        let server = testkit::RedisServer::start_owned().await;
        let waiters = spawn_notifier(server.client(), Duration::from_secs(2));
        let mut waiter = waiters.register("p:{k}:rel");
        assert!(
            waiter.subscribed(Duration::from_secs(10)).await,
            "subscription confirmed"
        );
        assert_eq!(
            publish(&server, "p:{k}:rel").await,
            1,
            "one shared subscriber"
        );
        tokio::time::timeout(Duration::from_secs(10), waiter.notified())
            .await
            .expect("woken by the announcement");

        server.stop().await;
        server.restart().await;
        // The task reconnects and subscribes again by itself: an announcement reaches it.
        let mut received = 0;
        for _ in 0..200 {
            received = publish(&server, "p:{k}:rel").await;
            if received == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(received, 1, "resubscribed after the restart");
        tokio::time::timeout(Duration::from_secs(10), waiter.notified())
            .await
            .expect("woken after the restart");
        // The last waiter leaving unsubscribes the channel.
        drop(waiter);
        let mut remaining = 1;
        for _ in 0..200 {
            remaining = publish(&server, "p:{k}:rel").await;
            if remaining == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert_eq!(remaining, 0, "unsubscribed when nobody waits");
    }
}
