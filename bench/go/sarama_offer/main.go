// Offers a fixed rate of 1 KiB records with Sarama's asynchronous producer
// (acks=all, flushed every linger ms, partitions in turn) for bench/partitions.py
// --client sarama, and reports each acknowledgement's latency. Like Kafka's Java
// client, Sarama sends a broker one Produce request holding the batches of every
// partition that has records; Debian's Sarama (1.22) sends a broker one request at
// a time (its producer's bridge goroutine waits for each answer). Records wait
// in a queue of the offer's own (as librdkafka's offer queues up to two million)
// rather than in Sarama's channels: ChannelBufferSize sizes every one of them,
// one per partition among them, and Sarama's default (256) is kept.
//
// Usage: sarama_offer BOOTSTRAP TOPIC PARTITIONS RATE SECONDS DRAIN LINGER_MS RECORD_BYTES
// Prints "offered acked failed seconds" (seconds from the first record to the
// last acknowledgement), then one latency in microseconds a line.
package main

import (
	"bufio"
	"crypto/rand"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/Shopify/sarama"
)

func arg(i int) float64 {
	v, err := strconv.ParseFloat(os.Args[i], 64)
	if err != nil {
		fmt.Fprintln(os.Stderr, "bad argument", os.Args[i])
		os.Exit(2)
	}
	return v
}

func main() {
	if len(os.Args) != 9 {
		fmt.Fprintln(os.Stderr, "usage: sarama_offer BOOTSTRAP TOPIC PARTITIONS RATE SECONDS DRAIN LINGER_MS RECORD_BYTES")
		os.Exit(2)
	}
	topic := os.Args[2]
	partitions, rate, seconds, drain := int32(arg(3)), arg(4), arg(5), arg(6)
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_0_0_0
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.Return.Successes = true
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	cfg.Producer.Flush.Frequency = time.Duration(arg(7) * float64(time.Millisecond))
	cfg.Producer.Timeout = time.Duration((seconds + drain) * float64(time.Second))
	// the connection waits for an answer as long as the broker is told to hold it (Sarama's own
	// 30 s would close it under a backlog and send every batch in flight again)
	cfg.Net.ReadTimeout = cfg.Producer.Timeout + 10*time.Second
	p, err := sarama.NewAsyncProducer([]string{os.Args[1]}, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(1)
	}
	value := make([]byte, int(arg(8)))
	rand.Read(value)

	var mu sync.Mutex
	var lat []int64
	var failed int
	var lastAck time.Time
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for m := range p.Successes() {
			now := time.Now()
			mu.Lock()
			lat = append(lat, now.Sub(m.Metadata.(time.Time)).Microseconds())
			lastAck = now
			mu.Unlock()
		}
	}()
	go func() {
		defer wg.Done()
		for e := range p.Errors() {
			fmt.Fprintln(os.Stderr, "failed:", e.Err)
			mu.Lock()
			failed++
			mu.Unlock()
		}
	}()

	// The offering loop never waits for the producer: a record waits in `queue` (its
	// latency counts from when it was offered) until this goroutine hands it to Sarama.
	// With ChannelBufferSize 1 << 16 instead, 10,000 partitions' channels took 4.4 GB
	// and the collector's passes over them, early in a load, held records for 100 ms
	// and more with nothing behind the listener (bench/history.md, session 91).
	queue := make(chan *sarama.ProducerMessage, 2_000_000)
	fed := make(chan struct{})
	go func() {
		defer close(fed)
		for m := range queue {
			p.Input() <- m
		}
	}()

	t0 := time.Now()
	offered := 0
	for {
		now := time.Since(t0).Seconds()
		if now >= seconds {
			break
		}
		for due := int(now * rate); offered < due; offered++ {
			queue <- &sarama.ProducerMessage{Topic: topic, Partition: int32(offered) % partitions,
				Value: sarama.ByteEncoder(value), Metadata: time.Now()}
		}
		time.Sleep(2 * time.Millisecond)
	}
	close(queue)
	deadline := time.Now().Add(time.Duration(drain * float64(time.Second)))
	for time.Now().Before(deadline) {
		mu.Lock()
		done := len(lat)+failed >= offered
		mu.Unlock()
		if done {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	<-fed // before closing its input
	p.AsyncClose()
	wg.Wait()

	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	secs := lastAck.Sub(t0).Seconds()
	if secs < seconds {
		secs = seconds
	}
	fmt.Fprintf(out, "%d %d %d %f\n", offered, len(lat), failed, secs)
	for _, l := range lat {
		fmt.Fprintln(out, l)
	}
}
