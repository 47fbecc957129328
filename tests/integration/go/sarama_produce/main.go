package main

import (
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/Shopify/sarama"
)

func main() {
	cfg := sarama.NewConfig()
	cfg.Version = sarama.V2_0_0_0
	cfg.Producer.RequiredAcks = sarama.WaitForAll
	cfg.Producer.Return.Successes = true
	cfg.Producer.Partitioner = sarama.NewManualPartitioner
	p, err := sarama.NewSyncProducer([]string{os.Args[1]}, cfg)
	if err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	n, _ := strconv.Atoi(os.Args[3])
	msgs := make([]*sarama.ProducerMessage, n)
	for i := range msgs {
		msgs[i] = &sarama.ProducerMessage{Topic: os.Args[2], Partition: 0, Timestamp: time.Now(),
			Value: sarama.StringEncoder(fmt.Sprintf("sarama-%d", i))}
	}
	if err := p.SendMessages(msgs); err != nil {
		fmt.Println("error:", err)
		os.Exit(1)
	}
	fmt.Println("acked", n)
	p.Close()
}
